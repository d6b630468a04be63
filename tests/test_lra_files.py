"""Tests for lra_files.py on small files written into tmp_path: byte ids, the notes a reader leaves, and the two
Pathfinder metadata formats. The real downloads are read through lra_data.load in tests/test_lra_data.py. CPU only."""
import numpy as np

from lra.files import EOS, aan_rows, byte_ids, pathfinder_index


def test_byte_ids_are_bytes_plus_4_cut_to_max_len_with_eos():
    assert byte_ids(b"\x00\xffab", 10).tolist() == [4, 259, ord("a") + 4, ord("b") + 4, EOS]
    ids = byte_ids(b"x" * 50, 8)
    assert ids.dtype == np.uint16 and ids.tolist() == [ord("x") + 4] * 7 + [EOS], "not cut to max_len - 1 + EOS"
    assert byte_ids(b"", 8).tolist() == [EOS], "an empty document is EOS only"


def test_aan_reader_notes_blank_lines_empty_and_cut_documents(tmp_path):
    rows = "1.0\ta\tb\t" + "x" * 20 + "\t\n\n0\tc\td\thi\tyo\n"            # one cut, one empty document, one blank line
    for name in ("train", "eval", "test"):
        (tmp_path / f"new_aan_pairs.{name}.tsv").write_text(rows)
    notes = []
    out = list(aan_rows(tmp_path, 8, notes))
    assert [(part, label) for part, _, label in out] == [(p, y) for p in ("train", "val", "test") for y in (1, 0)]
    assert out[0][1][1].tolist() == [EOS] and len(out[0][1][0]) == 8
    path = tmp_path / "new_aan_pairs.train.tsv"
    assert notes[:3] == [f"skipped 1 empty line in {path}", f"1 empty document in {path} (kept as EOS only)",
                         f"1 document in {path} cut to 7 bytes + EOS"], notes


def test_binary_metadata_of_the_original_generator_reads_like_the_text_format(tmp_path):
    lines = [f"imgs/0 sample_{j}.png {j} {j % 2} 1.0 14 4 2 0.5 1 1".split() for j in range(5)]
    text, binary = tmp_path / "text", tmp_path / "binary"
    for folder in (text, binary):
        (folder / "metadata").mkdir(parents=True)
    (text / "metadata" / "0.npy").write_text("".join(" ".join(f) + "\n" for f in lines))
    np.save(binary / "metadata" / "0.npy", np.array(lines))                # (5, 11) strings, as snakes2 saves them
    (paths_t, labels_t, notes_t), (paths_b, labels_b, notes_b) = (pathfinder_index(f, 32) for f in (text, binary))
    assert labels_t.tolist() == labels_b.tolist() == [0, 1, 0, 1, 0] and not notes_t and not notes_b
    assert [p.replace(str(binary), str(text)) for p in paths_b] == paths_t == [f"{text}/imgs/0/sample_{j}.png"
                                                                               for j in range(5)]
