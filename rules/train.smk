rule train_node:
    input:
        # `eval`: the tokenized eval set, with training.eval_every only
        unpack(held_out_input),
        # `reference`: the reference_logps files, with training.dpo.reference cached only (in params.held_out)
        unpack(reference_input),
        env=ENV_CHECK,
        plan=PLAN,
        tokens=TOKENIZED.format(shard="{node}"),
        packing=PACKING.format(shard="{node}"),
        base=BASE_MODEL_INPUT,
    output:
        metrics=TRAIN_METRICS,
        state=TRAIN_STATE,
    log:
        f"{VLOGS}/train_node/{{node}}.log",
    wildcard_constraints:
        node=one_of(NODES),
    conda:
        "../envs/train.yaml"
    threads: config["training"]["procs_per_node"]
    resources:
        # sbatch --gpus: one GPU a rank, from training.procs_per_node alone (the profile sets no GPU count);
        # one SLURM task, torchrun inside it (0: no --ntasks-per-gpu, which the plugin would add otherwise)
        gpu=GPUS_PER_NODE,
        tasks_per_gpu=0,
    params:
        # torchrun; on a machine without GPUs its ranks fork from it after the imports (ranks.py)
        ranks=script_path("train/ranks.py"),
        script=script_path("train/train.py"),
        config=training_json(),
        base=get_model,
        log_dir=TRAIN_DIR,
        # not an output: Snakemake deletes the outputs of failed jobs, and the retry resumes from here
        checkpoints=CHECKPOINTS,
        procs=config["training"]["procs_per_node"],
        held_out=held_out_args,
        trackers=trackers_json,
    shell:
        # each attempt's log is kept (rules/common.smk)
        ATTEMPT_LOG
        # Stop signals reach every process of the job step at once: SLURM's SIGURG warning before
        # the time limit (profiles/slurm), SIGTERM at the limit, on preemption or scancel. The ranks
        # finish their step, checkpoint and exit 75. This shell ignores both (SIGURG by default),
        # so that Snakemake sees the job end only after that, and does not delete metrics.jsonl
        # under the checkpoint; torchrun ignores SIGURG and passes SIGTERM on to the ranks.
        + "trap '' TERM;"
        # the job's cores are shared among its ranks, not given to each
        " n=$(( {threads} / {params.procs} > 1 ? {threads} / {params.procs} : 1 ));"
        " export OMP_NUM_THREADS=$n MKL_NUM_THREADS=$n OPENBLAS_NUM_THREADS=$n;"
        " python {params.ranks:q} --standalone --nproc_per_node {params.procs} --max-restarts 0"
        " {params.script:q} --config {params.config:q} --data {input.tokens} --packing {input.packing}"
        " --base-model {params.base:q} {params.held_out} --environment {input.env} --log-dir {params.log_dir:q}"
        " --checkpoint-root {params.checkpoints:q} --state {output.state}"
        " --trackers {params.trackers:q} >> {log} 2>&1"
        # torchrun reports a signal as a plain failure; the trainer's marker tells preemption apart
        " || {{ rc=$?; test -f {params.log_dir:q}/preempted.json && exit 75; exit $rc; }}"


# training.mode joint: one model over all nodes in one job, on every node's shard (launch.py)
rule train_joint:
    input:
        # `eval`: the tokenized eval set, with training.eval_every only
        unpack(held_out_input),
        # `reference`: the reference_logps files, with training.dpo.reference cached only (in params.held_out)
        unpack(reference_input),
        env=ENV_CHECK,
        plan=PLAN,
        tokens=expand(TOKENIZED, shard=NODES),
        packing=expand(PACKING, shard=NODES),
        base=BASE_MODEL_INPUT,
    output:
        metrics=TRAIN_METRICS.format(node="joint"),
        state=TRAIN_STATE.format(node="joint"),
    log:
        f"{VLOGS}/train_joint.log",
    conda:
        "../envs/train.yaml"
    threads: config["training"]["procs_per_node"]
    resources:
        # The node count is the experiment's (the config's), so the rule sets it, not the profile:
        # one SLURM task per node, each starting torchrun. `mpi` tells the slurm executor that the
        # shell starts its own srun, so it runs in the batch script, not inside a job step.
        nodes=config["nodes"],
        tasks=config["nodes"],
        mpi="srun",
        # per node (sbatch --gpus would count the whole job): training.procs_per_node, one GPU a rank;
        # one task a node (0: no --ntasks-per-gpu, which the plugin would take from `tasks` otherwise)
        gres=f"gpu:{GPUS_PER_NODE}",
        tasks_per_gpu=0,
    params:
        launch=script_path("train/launch.py"),
        script=script_path("train/train.py"),
        config=training_json(),
        base=get_model,
        log_dir=joint_log_dir,
        # not an output: Snakemake deletes the outputs of failed jobs, and the retry resumes from here
        checkpoints=CHECKPOINTS.format(node="joint"),
        trackers=trackers_json,
        nodes=config["nodes"],
        procs=config["training"]["procs_per_node"],
        held_out=held_out_args,
    shell:
        ATTEMPT_LOG
        + "python {params.launch:q} --nodes {params.nodes} --procs-per-node {params.procs} --threads {threads}"
        " -- {params.script:q} --config {params.config:q} --data {input.tokens} --packing {input.packing}"
        " --base-model {params.base:q} {params.held_out} --environment {input.env} --log-dir {params.log_dir:q}"
        " --checkpoint-root {params.checkpoints:q} --state {output.state}"
        " --trackers {params.trackers:q} >> {log} 2>&1"
        # srun and torchrun report a signal as a plain failure; the trainer's marker tells preemption apart
        " || {{ rc=$?; test -f {params.log_dir:q}/preempted.json && exit 75; exit $rc; }}"
