rule tokenize_shard:
    input:
        shard=NODE_SHARD,
        tokenizer=BASE_MODEL_INPUT,
    output:
        tokens=TOKENIZED,
        packing=PACKING,
        stats=TOKEN_STATS,
        rejects=TOKEN_REJECTS,
    log:
        f"{LOGS}/tokenize_shard/{{shard}}.log",
    conda:
        "../envs/data.yaml"
    params:
        script=script_path("data/tokenization.py"),
        config=TOKENIZE_CONFIG,
        tokenizer=TOKENIZER,
        training=NODE_TOKENIZE_ARGS,
    shell:
        "python {params.script:q} --config {params.config:q} --tokenizer {params.tokenizer:q}"
        " --shard {input.shard} {params.training}"
        " --output {output.tokens} --packing {output.packing} --stats {output.stats}"
        " --rejects {output.rejects} > {log} 2>&1"


use rule tokenize_shard as tokenize_eval with:
    input:
        shard=EVAL_SPLIT,
        tokenizer=BASE_MODEL_INPUT,
    output:
        tokens=TOKENIZED.format(shard="eval"),
        packing=PACKING.format(shard="eval"),
        stats=TOKEN_STATS.format(shard="eval"),
        rejects=TOKEN_REJECTS.format(shard="eval"),
    log:
        f"{LOGS}/tokenize_shard/eval.log",
    params:
        script=script_path("data/tokenization.py"),
        config=TOKENIZE_CONFIG,
        tokenizer=TOKENIZER,
        training="",  # the eval set is not trained on (of preference pairs, it holds the chosen answers)
