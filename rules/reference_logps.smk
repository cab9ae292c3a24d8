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
        shard=one_of([*NODES, EVAL_PAIRS]),
    conda:
        "../envs/train.yaml"
    params:
        script=script_path("train/reference_logps.py"),
        base=get_model,
        cache=reference_cache_args,
    shell:
        "python {params.script:q} --tokens {input.tokens} --base-model {params.base:q} {params.cache}"
        " --output {output.logps} > {log} 2>&1"


# The eval split's pairs with both answers (the eval set, tokenize_eval, keeps their chosen ones), for the held-out
# preference accuracy: each model's implicit reward margins against the same reference (the base model).
use rule tokenize_shard as tokenize_eval_pairs with:
    input:
        shard=EVAL_SPLIT,
        tokenizer=BASE_MODEL_INPUT,
    output:
        tokens=TOKENIZED.format(shard=EVAL_PAIRS),
        packing=PACKING.format(shard=EVAL_PAIRS),
        stats=TOKEN_STATS.format(shard=EVAL_PAIRS),
        rejects=TOKEN_REJECTS.format(shard=EVAL_PAIRS),
    log:
        f"{LOGS}/tokenize_shard/{EVAL_PAIRS}.log",
    params:
        script=script_path("data/tokenization.py"),
        config=TOKENIZE_CONFIG,
        tokenizer=TOKENIZER,
        training="--both-sides",


rule preference_eval:
    input:
        model=get_model,
        pairs=TOKENIZED.format(shard=EVAL_PAIRS),
        reference=REFERENCE_LOGPS.format(shard=EVAL_PAIRS),
    output:
        result=PREFERENCE_RESULT,
    log:
        f"{VLOGS}/preference_eval/{{model}}.log",
    conda:
        "../envs/train.yaml"
    params:
        script=script_path("evals/preference_eval.py"),
        model=get_model,
        beta=lambda wildcards: training_section(wildcards)["dpo"]["beta"],
    shell:
        "python {params.script:q} --model {params.model:q} --name {wildcards.model} --pairs {input.pairs}"
        " --reference {input.reference} --beta {params.beta} --output {output.result} > {log} 2>&1"
