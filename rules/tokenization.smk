rule tokenize_shard:
    input:
        shard=f"{R}/data/splits/{{shard}}.parquet",
        tokenizer=base_model_input(),
    output:
        tokens=f"{R}/data/tokenized/{{shard}}.parquet",
        packing=f"{R}/data/tokenized/{{shard}}.packing.parquet",
        stats=f"{R}/data/tokenized/{{shard}}.json",
    log:
        f"{LOGS}/tokenize_shard/{{shard}}.log",
    conda:
        "../envs/data.yaml"
    params:
        script=script_path("tokenization.py"),
        args=tokenize_args,
    shell:
        "python {params.script} --shard {input.shard} {params.args}"
        " --output {output.tokens} --packing {output.packing} --stats {output.stats} > {log} 2>&1"


use rule tokenize_shard as tokenize_eval with:
    input:
        shard=f"{R}/data/eval.parquet",
        tokenizer=base_model_input(),
    output:
        tokens=f"{R}/data/tokenized/eval.parquet",
        packing=f"{R}/data/tokenized/eval.packing.parquet",
        stats=f"{R}/data/tokenized/eval.json",
    log:
        f"{LOGS}/tokenize_shard/eval.log",
