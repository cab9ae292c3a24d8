# make publish only (publish.repo_id; the target `publish`): no other target asks for these outputs. It uploads,
# so it runs where Snakemake runs (the login node, with internet), never on a compute node.
localrules:
    publish,
    publish_model,


rule publish:
    input:
        publish_records,  # none configured: one line saying so


rule publish_model:
    input:
        model=MODEL_DIR,
        result=EVAL_RESULT,  # the card's model-index
    output:
        record=PUBLISH_RECORD,
    log:
        f"{VLOGS}/publish_model/{{model}}.log",
    conda:
        "../envs/eval.yaml"
    params:
        script=script_path("export/publish.py"),
        args=publish_args,
    shell:
        "python {params.script:q} --model {input.model} --name {wildcards.model} --eval {input.result}"
        " {params.args} --output {output.record} > {log} 2>&1"
