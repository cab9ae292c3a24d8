rule consolidate_node:
    input:
        # `scored`: the node's scored checkpoints, with consolidate.select best:<metric> only (checkpoint_eval.smk)
        unpack(selection_input),
        state=TRAIN_STATE,
    output:
        model=directory(MODEL_DIR.format(model="{node}")),
    log:
        f"{VLOGS}/consolidate_node/{{node}}.log",
    conda:
        "../envs/train.yaml"
    params:
        script=script_path("export/consolidate.py"),
        config=CONSOLIDATE_CONFIG,
    shell:
        "python {params.script:q} --state {input.state} --output {output.model} --config {params.config:q}"
        " > {log} 2>&1"
