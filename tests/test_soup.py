"""Model soup: the uniform soup's weights are the mean of the node weights; greedy keeps the best first."""

import json

import torch
from demo_model import build_model
from soup import average
from soup import main as soup_main
from transformers import AutoModelForCausalLM, AutoTokenizer


def test_average_is_the_elementwise_mean():
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0])}
    b = {"w": torch.tensor([3.0, 6.0]), "b": torch.tensor([1.0])}
    out = average([a, b])
    assert torch.equal(out["w"], torch.tensor([2.0, 4.0])) and torch.equal(out["b"], torch.tensor([0.5]))


def test_soups_of_node_models(tmp_path, demo_assets):
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
        ["--models", *map(str, paths), "--results", *map(str, results), "--eval", str(demo_assets["eval"]),
         "--uniform", str(tmp_path / "uniform"), "--greedy", str(tmp_path / "greedy")]
    )  # fmt: skip
    nodes = [AutoModelForCausalLM.from_pretrained(p).state_dict() for p in paths]
    uniform = AutoModelForCausalLM.from_pretrained(tmp_path / "uniform").state_dict()
    for key, value in uniform.items():
        torch.testing.assert_close(value, sum(n[key] for n in nodes) / 3, rtol=0, atol=1e-6)
    greedy = json.loads((tmp_path / "greedy" / "soup.json").read_text())
    assert greedy["members"][0] == "node1"  # the lowest held-out loss goes in first
    assert [t.get("tried") for t in greedy["trail"][1:]] == ["node0", "node2"]
