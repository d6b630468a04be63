"""Tests for listops.py: the value of an expression against the original ListOps test set (the shared_data fixture of
tests/conftest.py), the id layout, and that LRA's generator keeps LRA's rules. The two TSV formats are read through
lra_data.load in tests/test_lra_data.py. CPU only; generated files go into tmp_path."""
import pytest

from lra.listops import LISTOPS_ID, evaluate_listops, generate_listops, listops_tokens
from lra.files import N_SPECIAL, DataError
from conftest import shared_file

LISTOPS_TEST = "listops/nyu_listops_original/test_d20s.tsv"




def operator_depth_and_arity(tokens):
    """Deepest operator nesting and each operator's number of arguments, from tokens without parentheses."""
    n_args, deepest, arities = [0], 0, []        # n_args[-1]: arguments the innermost open operator has so far
    for t in tokens:
        if t == "]":
            arities.append(n_args.pop())
        else:
            n_args[-1] += 1
            if t.startswith("["):
                n_args.append(0)
                deepest = max(deepest, len(n_args) - 1)
    return deepest, arities


def test_evaluate_listops_reproduces_all_10000_original_test_labels(shared_data):
    rows = [line.split("\t") for line in shared_file(shared_data, LISTOPS_TEST).read_text().splitlines()]
    assert len(rows) == 10000
    wrong = [(label, expr) for label, expr in rows if evaluate_listops(expr) != int(label)]
    assert not wrong, f"{len(wrong)} labels differ, first: {wrong[0][0]} for {wrong[0][1][:80]}"


def test_ids_follow_the_special_ids_and_med_truncates_and_bad_expressions_raise():
    assert [LISTOPS_ID[s] for s in ("0", "9", "[MIN", "]")] == [N_SPECIAL, N_SPECIAL + 9, 14, 18], "id layout moved"
    assert listops_tokens("( [MAX 2 ( [MIN 4 7 ] ) 0 ] )") == ["[MAX", "2", "[MIN", "4", "7", "]", "0", "]"]
    assert evaluate_listops("( [MAX 2 ( [MIN 4 7 ] ) 0 ] )") == 4
    assert evaluate_listops("[MED 1 2 ]") == 1 and evaluate_listops("[SM 9 8 ]") == 7, "MED truncates, SM is mod 10"
    for bad in ("[MAX 2 ]]", "[MAX 2", "]", "3 4"):
        with pytest.raises(DataError, match="ListOps"):
            evaluate_listops(bad)


def test_listops_generator_follows_the_lra_rules_and_labels_match_evaluate(tmp_path):
    folder = generate_listops(tmp_path / "a", n_train=40, n_val=5, n_test=5, seed=1, min_length=20, max_length=200)
    generate_listops(tmp_path / "b", n_train=40, n_val=5, n_test=5, seed=1, min_length=20, max_length=200)
    real = generate_listops(tmp_path / "real", n_train=2, n_val=1, n_test=1)      # the real 500 < length < 2000 rule
    exprs = []
    for root, lo, hi in ((folder, 20, 200), (real, 500, 2000)):
        for part in ("train", "val", "test"):
            lines = (root / f"basic_{part}.tsv").read_text().splitlines()
            assert lines[0] == "Source\tTarget", "release header missing"
            for line in lines[1:]:
                expr, label = line.split("\t")
                tokens = listops_tokens(expr)
                depth, arities = operator_depth_and_arity(tokens)
                assert lo < len(tokens) < hi, f"length {len(tokens)} outside ({lo}, {hi})"
                assert depth <= 9, "an operator deeper than depth 9 (LRA forces digits at depth 10)"
                assert all(2 <= k <= 10 for k in arities), "an operator without 2..10 arguments"
                assert {t for t in tokens if t.startswith("[")} <= {"[MIN", "[MAX", "[MED", "[SM"}
                assert evaluate_listops(expr) == int(label)
                if root == folder:
                    exprs.append(expr)
    assert len(set(exprs)) == len(exprs) == 50, "duplicate trees across splits"
    for part in ("train", "val", "test"):
        again = (tmp_path / "b/listops-1000" / f"basic_{part}.tsv").read_bytes()
        assert (folder / f"basic_{part}.tsv").read_bytes() == again, "same seed, different data"
