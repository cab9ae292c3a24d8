# training.objective dpo with training.dpo.reference cached (and a loss that has a reference): the base model's
# summed log-probability of every tokenized pair's answers, computed once per shard in fp32
# (workflow_scripts/train/reference_logps.py) and cached by content (the model's files, the shard's bytes) beside
# the tokenization cache, so a new beta, loss or learning rate reuses it.
rule reference_logps:
    input:
        tokens=TOKENIZED,
        base=BASE_MODEL_INPUT,
    output:
        logps=REFERENCE_LOGPS,
    log:
        f"{LOGS}/reference_logps/{{shard}}.log",
    wildcard_constraints:
        shard="|".join(NODES),
    conda:
        "../envs/train.yaml"
    params:
        script=script_path("train/reference_logps.py"),
        base=get_model,
        cache=reference_cache_args,
    shell:
        "python {params.script:q} --tokens {input.tokens} --base-model {params.base:q} {params.cache}"
        " --output {output.logps} > {log} 2>&1"
