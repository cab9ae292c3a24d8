"""dry_run_summary.py: the jobs per partition and rule and the GPU-hours requested, from a dry run's text."""

from workflow_scripts.ops.dry_run_summary import (
    gpus,
    local_rules,
    main,
    minutes,
    parse_dry_run,
    parse_resources,
    render,
    summarize,
)

# captured from `snakemake -n --profile profiles/slurm` (Snakemake 9.27), shortened; a joint job's lines as the
# slurm profile's train_joint section gives them (gres per node, nodes from the rule)
DRY_RUN = """\
Building DAG of jobs...
Job stats:
job                  count
-----------------  -------
check_environment        1
total                   28

[Fri Nov 27 18:14:15 2026]
rule split_dataset:
    input: resources/demo/instructions.csv
    output: results/d/data/splits/node0.parquet
    log: logs/d/split_dataset.log
    jobid: 4
    reason: Missing output files: results/d/data/manifest.json
    resources: tmpdir=/tmp, disk=1 GB, mem_mb=16000, slurm_partition=cpu, slurm_account=, runtime=60
[Fri Nov 27 18:14:15 2026]
rule check_environment:
    output: results/d/env/check.json
    resources: tmpdir=/tmp, mem_mb=16000, slurm_partition=gpu, runtime=20, nodes=1, gpu=4, tasks_per_gpu=0
[Fri Nov 27 18:14:15 2026]
rule plan_training:
    output: results/d/plan/memory.json
    resources: tmpdir=/tmp, mem_mb=8000, slurm_partition=gpu, slurm_account=, runtime=60, cpus_per_task=2
[Fri Nov 27 18:14:15 2026]
rule train_node:
    wildcards: node=node0
    resources: disk_mb=<TBD>, slurm_partition=gpu, runtime=1440, gpu=4, slurm_extra=--signal=URG@600
[Fri Nov 27 18:14:15 2026]
rule train_node:
    wildcards: node=node1
    resources: disk_mb=<TBD>, slurm_partition=gpu, runtime=1440, gpu=4, slurm_extra=--signal=URG@600
[Fri Nov 27 18:14:15 2026]
rule train_joint:
    resources: mem_mb=476000, slurm_partition=gpu, runtime=2160, gres=gpu:a100:8, nodes=2, tasks_per_gpu=0
[Fri Nov 27 18:14:15 2026]
rule render_summary_page:
    wildcards: run=d
    resources: tmpdir=/tmp, mem_mb=8000, slurm_partition=gpu, runtime=60
[Fri Nov 27 18:14:15 2026]
rule tokenize_shard:
    wildcards: shard=node0
    resources: tmpdir=/tmp, mem_mb=16000, slurm_partition=, runtime=120, cpus_per_task=2
[Fri Nov 27 18:14:15 2026]
rule all:
    input: results/d/models/node0
    resources: tmpdir=/tmp, mem_mb=8000, slurm_partition=gpu, runtime=60
This was a dry-run (flag -n). The order of jobs does not reflect the order of execution.
"""


def test_resources_keep_values_with_equals_signs():
    r = parse_resources("tmpdir=/tmp, slurm_account=, runtime=1440, slurm_extra=--signal=URG@600, gres=gpu:8")
    assert r == {"tmpdir": "/tmp", "slurm_account": "", "runtime": "1440", "slurm_extra": "--signal=URG@600",
                 "gres": "gpu:8"}  # fmt: skip


def test_gpus_and_time_limits():
    assert gpus({"gpu": "4", "nodes": "1"}) == 4
    assert gpus({"gres": "gpu:a100:8", "nodes": "2"}) == 16  # gres is per node
    assert gpus({"gres": "gpu:2"}) == 2 and gpus({"mem_mb": "8000"}) == 0
    assert minutes("1440") == 1440 and minutes("2h 30m") == 150 and minutes("1d") == 1440
    assert minutes("<TBD>") is None and minutes(None) is None


def test_jobs_per_partition_and_gpu_hours():
    jobs = parse_dry_run(DRY_RUN)
    assert [j.rule for j in jobs] == ["split_dataset", "check_environment", "plan_training", "train_node", "train_node",
                                      "train_joint", "render_summary_page", "tokenize_shard", "all"]  # fmt: skip
    rows, local = summarize(jobs, {"plan_training", "render_summary_page"})
    by = {(r.partition, r.rule): r for r in rows}
    assert set(by) == {("gpu", "train_joint"), ("gpu", "train_node"), ("gpu", "check_environment"),
                       ("cpu", "split_dataset"), ("(cluster default)", "tokenize_shard")}  # fmt: skip
    assert by["gpu", "train_node"].jobs == 2 and by["gpu", "train_node"].gpu_hours == 2 * 4 * 24
    assert by["gpu", "train_joint"].gpu_hours == 16 * 36
    assert round(by["gpu", "check_environment"].gpu_hours, 3) == round(4 * 20 / 60, 3)
    assert rows[0].rule == "train_joint"  # the most GPU-hours first
    assert local == ["plan_training", "1 report page(s) (render_*_page)"]
    text = render(rows, local)
    assert "total: 6 job(s) submitted" in text
    assert f"{16 * 36 + 2 * 4 * 24 + 4 * 20 / 60:.1f} GPU-hours requested" in text
    assert "gpu 4 job(s)" in text and "cpu 1 job(s), 0.0 GPU-h" in text


def test_the_workflows_local_rules_are_found():
    names = local_rules()
    assert {"plan_training", "render_summary_page", "render_data_page", "render_grid_page"} <= names
    assert "train_node" not in names and "summarize" not in names


def test_reads_a_saved_dry_run(tmp_path, capsys):
    saved = tmp_path / "dry.txt"
    saved.write_text(DRY_RUN)
    assert main(["--read", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "train_node" in out and "GPU-hours requested" in out
