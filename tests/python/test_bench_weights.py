"""`vitrify bench weights`' pure parts (the benchmark itself needs a GPU)."""

from vitrify.bench import weights


def test_the_delta_changes_one_percent_of_the_tensors_spread_over_the_layers():
    names = (["embedding.word_embeddings.weight", "output_layer.weight",
              "decoder.final_layernorm.weight"]
             + [f"decoder.layers.{i}.{t}" for i in range(36) for t in "abcdef"])
    changed = weights._changed(names)
    assert len(changed) == 2  # 1 % of 219
    assert all(".layers." in n for n in changed)
    assert len({n.split(".")[2] for n in changed}) == 2  # two different layers
    assert weights._changed(["a", "b"]) == ["b"]  # no layer tensors: still one
