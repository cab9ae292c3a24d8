rule build_demo_model:
    input:
        data=data_inputs(),
    output:
        model=directory(DEMO_MODEL),
    log:
        f"{LOGS}/build_demo_model.log",
    conda:
        "../envs/data.yaml"
    params:
        script=script_path("demo_model.py"),
        data=data_spec,
        format=config["data"]["format"],
        mapping=config["data"]["mapping"],
        columns=json.dumps(config["data"]["columns"]),
        vocab=config["model"]["demo_vocab_size"],
        max_len=config["data"]["max_seq_len"],
        seed=config["model"]["seed"],
        preset=PRESET,
    shell:
        "python {params.script} --data {params.data:q} --format {params.format} --mapping {params.mapping}"
        " --columns {params.columns:q} --vocab-size {params.vocab}"
        " --max-seq-len {params.max_len} --seed {params.seed} --preset {params.preset}"
        " --output {output.model}"
        " > {log} 2>&1"
