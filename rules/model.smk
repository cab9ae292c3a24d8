rule build_demo_model:
    input:
        data=config["data"]["path"],
    output:
        model=directory(f"{R}/base_model"),
    params:
        vocab=config["model"]["demo_vocab_size"],
        max_len=config["data"]["max_seq_len"],
        seed=config["model"]["seed"],
    log:
        f"{LOGS}/build_demo_model.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python {SCRIPTS}/demo_model.py --data {input.data} --vocab-size {params.vocab}"
        " --max-seq-len {params.max_len} --seed {params.seed} --output {output.model}"
        " > {log} 2>&1"
