"""The README's and docs' tables are made from the committed result files (tables.py): each equals what
its files make, so a table edited by hand fails here, and a figure changed in a file changes the table."""
import json
import shutil

import pytest

import tables
from conftest import ROOT


def marked(page):
    return [(m.group(2), m.group(3)) for m in tables.MARKED.finditer(page.read_text())]


def test_every_table_is_what_its_result_files_make():
    stale = [f"{page.relative_to(ROOT)}: {name}" for page in tables.PAGES for name, text in marked(page)
             if text != tables.render(name)]
    assert not stale, f"tables that differ from their result files (run `python tables.py`): {stale}"


def test_every_table_is_shown_somewhere_and_every_result_file_is_used():
    shown = {name for page in tables.PAGES for name, _ in marked(page)}
    assert shown == set(tables.TABLES)
    used = {file for _, files in tables.TABLES.values() for file in files}
    assert used == {p.name for p in tables.RESULTS.glob("*.json")}
    for file in used:  # each says what made it
        assert set(json.loads((tables.RESULTS / file).read_text())["run"]) == {"command", "commit", "date", "machine"}


@pytest.mark.parametrize("name", sorted(tables.TABLES))
def test_a_figure_changed_in_a_result_file_changes_its_table(name, tmp_path):
    """Every number of the first file's first group, placement or run scaled by 3: the table moves."""
    results = tmp_path / "results"
    shutil.copytree(tables.RESULTS, results)
    first = results / tables.TABLES[name][1][0]
    figures = json.loads(first.read_text())

    def scaled(value):
        if isinstance(value, dict):
            return {k: scaled(v) for k, v in value.items()}
        if isinstance(value, list):
            return [scaled(v) for v in value]
        return value * 3 if isinstance(value, float) else value

    for key in ("groups", "placements", "runs"):
        if key in figures:
            head = next(iter(figures[key]))
            figures[key][head] = scaled(figures[key][head])
    first.write_text(json.dumps(figures))
    assert tables.render(name, results) != tables.render(name)
    page = "intro\n<!-- table: " + name + " -->\nold\n<!-- /table -->\nafter\n"
    assert tables.refresh(page, results) == f"intro\n<!-- table: {name} -->\n{tables.render(name, results)}<!-- /table -->\nafter\n"


def test_a_marker_of_no_known_table_says_which_there_are():
    with pytest.raises(SystemExit, match="no such table; tables.py knows sim-summary"):
        tables.refresh("<!-- table: sims -->\nx\n<!-- /table -->\n")


def test_a_simulated_table_says_its_seeds_updates_and_timed_updates_each_preset_its_own():
    paper = {"preset": "paper", "seeds": [0, 1, 2], "updates": "ready", "steps": 6}
    h200 = {**paper, "preset": "h200", "steps": 2}
    assert tables.seeds_line(paper) == ["Seeds 0, 1, 2, `--updates ready`, 6 timed updates a run; each figure is "
                                        "the mean over the seeds, the lowest and highest seed's in brackets.", ""]
    assert [line.split(":")[0] for line in tables.seeds_line(paper, h200)[:2]] == ["Paper", "H200"]
    assert "2 timed updates" in tables.seeds_line(paper, h200)[1]
