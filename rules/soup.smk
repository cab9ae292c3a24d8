rule make_soup:
    input:
        models=expand(f"{R}/models/{{node}}", node=NODES),
        results=expand(f"{R}/eval/{{node}}.json", node=NODES),
        eval=f"{R}/data/tokenized/eval.parquet",
    output:
        uniform=directory(f"{R}/models/soup_uniform"),
        greedy=directory(f"{R}/models/soup_greedy"),
    log:
        f"{LOGS}/make_soup.log",
    conda:
        "../envs/eval.yaml"
    params:
        script=script_path("soup.py"),
    shell:
        "python {params.script} --models {input.models} --results {input.results} --eval {input.eval}"
        " --uniform {output.uniform} --greedy {output.greedy} > {log} 2>&1"
