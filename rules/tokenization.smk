rule tokenize_shard:
    input:
        shard=f"{R}/data/splits/{{shard}}.parquet",
        tokenizer=base_model_input(),
    output:
        tokens=f"{R}/data/tokenized/{{shard}}.parquet",
        stats=f"{R}/data/tokenized/{{shard}}.json",
    log:
        f"{LOGS}/tokenize_shard/{{shard}}.log",
    conda:
        "../envs/data.yaml"
    params:
        script=script_path("tokenization.py"),
        tokenizer=base_model_ref,
        max_len=config["data"]["max_seq_len"],
        overlength=config["data"]["overlength"],
    shell:
        "python {params.script} --shard {input.shard} --tokenizer {params.tokenizer}"
        " --max-seq-len {params.max_len} --overlength {params.overlength}"
        " --output {output.tokens} --stats {output.stats} > {log} 2>&1"


use rule tokenize_shard as tokenize_eval with:
    input:
        shard=f"{R}/data/eval.parquet",
        tokenizer=base_model_input(),
    output:
        tokens=f"{R}/data/tokenized/eval.parquet",
        stats=f"{R}/data/tokenized/eval.json",
    log:
        f"{LOGS}/tokenize_shard/eval.log",
