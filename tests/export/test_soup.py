"""Model soup: the uniform soup's weights are the mean of the node weights; greedy keeps the best first."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from workflow_scripts.core.pipeline_io import UserError
from workflow_scripts.export.soup import MeanSource
from workflow_scripts.export.soup import main as soup_main
from workflow_scripts.model.demo_model import build_model
from workflow_scripts.model.weights import CheckpointFiles


def node_files(folder, tensors: dict):
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    return CheckpointFiles(folder)


def test_mean_source_is_the_elementwise_mean_read_tensor_by_tensor(tmp_path):
    a = node_files(tmp_path / "a", {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0])})
    b = node_files(tmp_path / "b", {"w": torch.tensor([3.0, 6.0]), "b": torch.tensor([1.0])})
    source = MeanSource([a, b])
    assert source.shapes == {"b": torch.Size([1]), "w": torch.Size([2])}
    out = source.read(["w"])  # only the tensors asked for
    assert list(out) == ["w"] and torch.equal(out["w"], torch.tensor([2.0, 4.0]))
    assert torch.equal(source.read(["b"])["b"], torch.tensor([0.5]))
    source.close()
    c = node_files(tmp_path / "c", {"w": torch.tensor([3.0, 6.0, 9.0]), "b": torch.tensor([1.0])})
    with pytest.raises(UserError, match=r"^model soup: .*/c differs in architecture from .*/a$"):
        MeanSource([CheckpointFiles(tmp_path / "a"), c])


def test_mean_source_equals_the_stacked_mean_bit_for_bit(tmp_path):
    """Summed in order then divided, without stacking the nodes: the same bits as torch.stack(...).mean(0)."""
    g = torch.Generator().manual_seed(0)
    nodes = [{"w": torch.randn(257, 33, generator=g).to(torch.bfloat16)} for _ in range(3)]
    source = MeanSource([node_files(tmp_path / f"n{i}", t) for i, t in enumerate(nodes)])
    expected = torch.stack([n["w"].float() for n in nodes]).mean(0)
    assert torch.equal(source.read(["w"])["w"], expected)
    source.close()


@pytest.fixture(scope="module")
def eval_rows(demo_assets, tmp_path_factory):
    """The first rows of the tokenized eval set: greedy's held-out losses are of no consequence here (the
    node results' losses are far below any of these untrained models'), only their forward passes' cost."""
    import pandas as pd

    path = tmp_path_factory.mktemp("soup") / "eval.parquet"
    pd.read_parquet(demo_assets["eval"]).head(4).to_parquet(path)
    return path


def test_soups_of_node_models(tmp_path, demo_assets, eval_rows):
    tokenizer = AutoTokenizer.from_pretrained(demo_assets["base"])
    paths, results = [], []
    for i, loss in enumerate([2.0, 1.0, 3.0]):
        path = tmp_path / f"node{i}"
        build_model(tokenizer, 128, seed=i).save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(path)
        result = tmp_path / f"node{i}.json"
        result.write_text(json.dumps({"model": f"node{i}", "eval_loss": loss}))
        results.append(result)
    soup_main(
        ["--models", *map(str, paths), "--results", *map(str, results), "--eval", str(eval_rows),
         "--uniform", str(tmp_path / "uniform"), "--greedy", str(tmp_path / "greedy")]
    )  # fmt: skip
    nodes = [AutoModelForCausalLM.from_pretrained(p).state_dict() for p in paths]
    uniform = AutoModelForCausalLM.from_pretrained(tmp_path / "uniform").state_dict()
    for key, value in uniform.items():
        torch.testing.assert_close(value, sum(n[key] for n in nodes) / 3, rtol=0, atol=1e-6)
    greedy = json.loads((tmp_path / "greedy" / "soup.json").read_text())
    assert greedy["members"][0] == "node1"  # the lowest held-out loss goes in first
    assert [t.get("tried") for t in greedy["trail"][1:]] == ["node0", "node2"]
    from huggingface_hub import ModelCard

    card = ModelCard.load(tmp_path / "greedy" / "README.md")  # node folders without cards: no base named
    assert card.data.library_name == "transformers" and card.data.base_model is None
    assert f"Members: {', '.join(greedy['members'])};" in card.text


def test_soups_of_bf16_models_average_in_fp32_and_are_saved_in_bf16(tmp_path, demo_assets, eval_rows):
    """Node models consolidated in bf16 (a bf16 base): the soup is the fp32 mean, rounded once to bf16."""
    tokenizer = AutoTokenizer.from_pretrained(demo_assets["base"])
    paths, results = [], []
    for i, loss in enumerate([2.0, 1.0]):
        path = tmp_path / f"node{i}"
        build_model(tokenizer, 128, seed=i).to(torch.bfloat16).save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(path)
        results.append(tmp_path / f"node{i}.json")
        results[-1].write_text(json.dumps({"model": f"node{i}", "eval_loss": loss}))
    soup_main(
        ["--models", *map(str, paths), "--results", *map(str, results), "--eval", str(eval_rows),
         "--uniform", str(tmp_path / "uniform"), "--greedy", str(tmp_path / "greedy")]
    )  # fmt: skip
    nodes = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).state_dict() for p in paths]
    for soup in ("uniform", "greedy"):
        assert json.loads((tmp_path / soup / "config.json").read_text())["dtype"] == "bfloat16"
    uniform = AutoModelForCausalLM.from_pretrained(tmp_path / "uniform").state_dict()
    assert {v.dtype for v in uniform.values()} == {torch.bfloat16}
    for key, value in uniform.items():
        assert torch.equal(value, ((nodes[0][key] + nodes[1][key]) / 2).to(torch.bfloat16)), key
