rule consolidate_node:
    input:
        state=f"{R}/train/{{node}}/train_state.json",
    output:
        model=directory(f"{R}/models/{{node}}"),
    log:
        f"{LOGS}/consolidate_node/{{node}}.log",
    conda:
        "../envs/train.yaml"
    shell:
        "python {SCRIPTS}/consolidate.py --state {input.state} --output {output.model} > {log} 2>&1"
