rule consolidate_node:
    input:
        state=f"{R}/train/{{node}}/train_state.json",
    output:
        model=directory(f"{R}/models/{{node}}"),
    log:
        f"{LOGS}/consolidate_node/{{node}}.log",
    conda:
        "../envs/train.yaml"
    params:
        script=script_path("consolidate.py"),
    shell:
        "python {params.script} --state {input.state} --output {output.model} > {log} 2>&1"
