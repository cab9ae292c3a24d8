# eval.checkpoints all or every_n: each kept checkpoint consolidated and scored as its own jobs, then
# eval/checkpoints.csv and its curves; the helpers, and why, are in rules/common_checkpoints.smk.


if SCORE_CHECKPOINTS:
    # the training rules become Snakemake checkpoints here only: a run with eval.checkpoints last plans as before
    as_snakemake_checkpoints(["train_node", "train_joint"])

    rule consolidate_checkpoint:
        input:
            marker=checkpoint_marker,
        output:
            model=temp(directory(CHECKPOINT_MODEL)),
        log:
            f"{VLOGS}/consolidate_checkpoint/{{node}}/{{key}}/step-{{step}}.log",
        wildcard_constraints:
            key="[0-9a-f]+",
            step=r"\d+",
        conda:
            "../envs/train.yaml"
        params:
            script=script_path("export/consolidate.py"),
            state=node_state,
            checkpoint=checkpoint_folder,
            config=CHECKPOINT_CONSOLIDATE_CONFIG,
        shell:
            "python {params.script:q} --state {params.state:q} --checkpoint {params.checkpoint:q}"
            " --output {output.model} --config {params.config:q} > {log} 2>&1"

    # as evaluate_model, on the same SLURM partition and resources (profiles/)
    rule evaluate_checkpoint:
        input:
            model=CHECKPOINT_MODEL,
            eval=TOKENIZED.format(shard="eval"),
            task_files=EVAL_TASK_FILES,
        output:
            result=CHECKPOINT_EVAL,
            lm_eval=CHECKPOINT_LM_EVAL,
        log:
            f"{VLOGS}/evaluate_checkpoint/{{node}}/{{key}}/step-{{step}}.log",
        wildcard_constraints:
            key="[0-9a-f]+",
            step=r"\d+",
        conda:
            EVAL_ENV
        params:
            python=EVAL_PYTHON,
            script=script_path("evals/evaluation.py"),
            config=EVAL_CONFIG,
        shell:
            "{params.python:q} {params.script:q} --model {input.model:q} --name {wildcards.node}"
            " --eval {input.eval} --config {params.config:q}"
            " --output {output.result} --lm-eval-output {output.lm_eval} > {log} 2>&1"

    rule checkpoint_scores:
        input:
            states=expand(TRAIN_STATE, node=TRAINED, allow_missing=True),
            results=checkpoint_results,
        output:
            table=CHECKPOINT_SCORES,
            plot=report(
                CHECKPOINT_PLOT,
                caption="../report/checkpoints.rst",
                category="Evaluation",
                subcategory="3. Per checkpoint",
            ),
        log:
            f"{VLOGS}/checkpoint_scores.log",
        conda:
            "../envs/eval.yaml"
        params:
            script=script_path("evals/checkpoint_scores.py"),
            scores=scores_root,
            mode=CHECKPOINTS_MODE,
            every=EVAL["checkpoint_every"],
        shell:
            "python {params.script:q} --states {input.states} --results {input.results}"
            " --scores-root {params.scores:q} --mode {params.mode} --every {params.every}"
            " --output {output.table} --plot {output.plot} > {log} 2>&1"
