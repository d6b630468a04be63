"""Facts about tools/attention_offsets.py: attention that is exactly local has mean distance 0 or 1, uniform attention
has the closed-form expectation (padding and causal masks counted), and a run folder's checkpoints are read whole."""
import json
import math

import pytest
import torch

from conftest import run
from lra.listops import generate_listops
from tools import attention_offsets as ao
from transformer import Transformer, TransformerConfig


def distance(a, lengths):
    mass, queries = ao.offset_sums(a, lengths)                     # (nh, L), count
    return (mass / queries) @ torch.arange(a.size(-1), dtype=torch.float64), mass / queries


def test_attention_to_itself_has_distance_0_and_to_a_neighbour_distance_1():
    L, lengths = 9, torch.tensor([9, 5])
    eye = torch.eye(L).expand(2, 1, L, L)                          # head 0: a_ii = 1
    nxt = torch.zeros(2, 1, L, L)                                  # head 1: a_i,i+1 = 1 (the last real one: i − 1)
    for b, n in enumerate(lengths.tolist()):
        for i in range(n):
            nxt[b, 0, i, i + 1 if i + 1 < n else i - 1] = 1
    d, mass = distance(torch.cat([eye, nxt], 1), lengths)
    torch.testing.assert_close(d, torch.tensor([0.0, 1.0], dtype=torch.float64), msg="local attention's distance")
    assert mass[0, 0] == 1 and mass[1, 1] == 1, "all mass at offset 0 (head 0) and 1 (head 1)"


@pytest.mark.parametrize("causal", [False, True])
def test_uniform_attention_gives_the_closed_form_expectation_with_padding(causal):
    lengths, L = torch.tensor([7, 12, 3]), 12                      # padded to 12: pads must not count
    d, mass = distance(ao.uniform_attention(lengths, L, causal), lengths)
    n = lengths.double()
    expected = ((n - 1) / 4 if causal else (n * n - 1) / (3 * n)) @ n / n.sum()   # mean over the 22 real queries
    assert d.item() == pytest.approx(expected.item(), rel=1e-12), f"uniform distance {d.item()} != {expected.item()}"
    assert ao.uniform_distance(12, causal) == pytest.approx(distance(ao.uniform_attention(torch.tensor([12]), 12,
                                                                                          causal), None)[0].item())
    assert mass.sum().item() == pytest.approx(1.0), "the mass by offset of a query sums to 1"
    # by hand, bidirectional, n = 3: offsets 0 (3 pairs), 1 (4), 2 (2) of 9 -> mean 8/9 = (9 − 1) / 9
    assert ao.uniform_distance(3) == pytest.approx(8 / 9) and ao.uniform_distance(5, causal=True) == 1.0


def test_model_attention_profile_sums_to_one_and_matches_the_weights_of_attend():
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32, dropout=0.0, vocab_size=10,
                                          pos="sinusoidal")).eval()
    x, lengths = torch.randint(1, 10, (3, 14)), torch.tensor([14, 9, 4])
    out = ao.analyse(model, [(x, lengths)])
    assert out["queries"] == 27 and len(out["layers"]) == 2
    for layer in out["layers"]:
        mass = torch.tensor(layer["mass_by_offset"], dtype=torch.float64)   # (nh, L)
        torch.testing.assert_close(mass.sum(1), torch.ones(2, dtype=torch.float64))
        torch.testing.assert_close(torch.tensor(layer["mean_distance"], dtype=torch.float64), mass @ torch.arange(14.0).double())
        n = lengths.double()
        assert layer["uniform_distance"] == pytest.approx((((n * n - 1) / (3 * n)) @ n / n.sum()).item())
    scores = torch.tensor(out["position_scores_by_offset"])         # (nh, L): by offset from the code alone
    assert scores.shape == (2, 14) and torch.isfinite(scores).all()
    rotary = Transformer(TransformerConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, vocab_size=10)).eval()
    assert ao.analyse(rotary, [(x, None)])["position_scores_by_offset"] is None, "rotary adds no code to the input"


def test_position_scores_are_the_first_layers_code_only_scores_averaged_by_offset():
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(d_model=8, n_layers=1, n_heads=2, d_ff=8, dropout=0.0, vocab_size=5,
                                          pos="learned", max_len=6)).eval()
    layer, P = model.layers[0], model.pos_embedding.weight.detach()   # (6, D)
    q, k, _ = layer.qkv(layer.norm1(P)).detach().double().view(6, 3, 2, 4).unbind(1)   # (L, nh, hs) each
    by_hand = torch.zeros(2, 6, dtype=torch.float64)
    for d in range(6):                                             # the pairs at offset d, both directions
        pairs = [(i, j) for i in range(6) for j in range(6) if abs(i - j) == d]
        by_hand[:, d] = sum((q[i] * k[j]).sum(-1) / 2 for i, j in pairs) / len(pairs)   # √hs = 2
    torch.testing.assert_close(ao.position_scores(model, 6), by_hand, rtol=1e-5, atol=1e-6)


def test_a_run_folder_gives_attention_json_for_spt_and_best(tmp_path):
    generate_listops(tmp_path, 200, 40, 40, min_length=30, max_length=200)
    _, run_dir = run(tmp_path, tmp_path / "runs", "--model", "transformer", "--task", "listops", "--spt", "--pos",
                     "sinusoidal", "--pretrain-epochs", "1", "--epochs", "1")
    result = ao.main([str(run_dir), "--plot", str(tmp_path / "cell.png")])[0]
    assert torch.is_grad_enabled(), "the tool switched autograd off for the rest of the process"
    saved = json.loads((run_dir / "attention.json").read_text())
    assert saved == json.loads(json.dumps(result)) and set(saved["checkpoints"]) == {"spt.pt", "best.pt"}
    assert (saved["pos"], saved["spt"], saved["checkpoints"]["spt.pt"]["phase"]) == ("sinusoidal", True, "spt")
    for c in saved["checkpoints"].values():
        assert c["queries"] > 0 and c["position_scores_by_offset"] is not None
        for layer in c["layers"]:
            assert all(0 <= d <= c["length"] for d in layer["mean_distance"])
            # each head's mass sums to 1: the model's float32 softmax rows sum to 1 within a few float32 ulps (the
            # rounding differs between CPU models: 1.2e-9 off on an Intel Xeon), so float32's tolerance, not float64's
            assert math.isclose(sum(map(sum, layer["mass_by_offset"])), len(layer["mean_distance"]), rel_tol=1e-6)
    assert (tmp_path / "cell.png").stat().st_size > 1000
    ao.main([str(run_dir), "--plot", str(tmp_path / "cell.png"), "--max-examples", "4"])   # its own files: rewritten
    assert json.loads((run_dir / "attention.json").read_text())["checkpoints"]["best.pt"]["queries"] < \
        saved["checkpoints"]["best.pt"]["queries"]


def test_attention_json_and_the_plot_never_replace_a_users_file_and_are_refused_before_the_analysis(tmp_path, capsys,
                                                                                                    monkeypatch):
    generate_listops(tmp_path, 200, 40, 40, min_length=30, max_length=200)
    _, run_dir = run(tmp_path, tmp_path / "runs", "--model", "transformer", "--task", "listops", "--epochs", "1")
    monkeypatch.setattr(ao, "analyse_run", lambda *a: pytest.fail("analysed before refusing"))
    for mine, argv in ((run_dir / "attention.json", [str(run_dir)]),
                       (tmp_path / "mine.png", [str(run_dir), "--plot", str(tmp_path / "mine.png")])):
        mine.write_text("the user's")
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            ao.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and f"{mine} exists and is not in" in err[0]
        assert mine.read_text() == "the user's"
        if mine.name == "attention.json":
            mine.unlink()



def test_a_run_whose_data_has_moved_is_refused_in_one_line_and_nothing_is_generated_in_its_place(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    generate_listops(data, 200, 40, 40, min_length=30, max_length=200)
    _, run_dir = run(data, tmp_path / "runs", "--model", "transformer", "--task", "listops", "--epochs", "1")
    data.rename(tmp_path / "moved")
    data.mkdir()                                                  # the old place exists, empty: nothing may appear
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        ao.main([str(run_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("attention_offsets.py: error: the run's data"), err
    assert list(data.iterdir()) == [], "substitute data was generated at the run's old data folder"
    for bad in (["--batch-size", "0"], ["--max-examples", "-1"]):
        with pytest.raises(SystemExit) as e:
            ao.main([str(run_dir), *bad])
        assert e.value.code == 2 and bad[0] in capsys.readouterr().err
