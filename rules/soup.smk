rule make_soup:
    input:
        models=expand(MODEL_DIR, model=NODES, allow_missing=True),
        results=expand(EVAL_RESULT, model=NODES, allow_missing=True),
        eval=TOKENIZED.format(shard="eval"),
    output:
        uniform=directory(MODEL_DIR.format(model="soup_uniform")),
        greedy=directory(MODEL_DIR.format(model="soup_greedy")),
    log:
        f"{VLOGS}/make_soup.log",
    conda:
        "../envs/eval.yaml"
    params:
        script=script_path("export/soup.py"),
    shell:
        "python {params.script:q} --models {input.models} --results {input.results} --eval {input.eval}"
        " --uniform {output.uniform} --greedy {output.greedy} > {log} 2>&1"
