"""docs/config.md is what `python -m cadence.config.doc` writes from the config's descriptions."""

from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from cadence.config import Config
from cadence.config import doc as config_doc

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "config.md"


def test_config_reference_is_up_to_date():
    assert PAGE.read_text() == config_doc.render(), (
        "docs/config.md differs from the config's field descriptions: regenerate it with "
        "`python -m cadence.config.doc` from the repository root and commit the result"
    )


def _rows(section: str) -> dict[str, list[str]]:
    """The reference's table rows of one section, by key."""
    lines = config_doc.render().splitlines()
    start = lines.index(f"## `[{section}]`")
    rows = {}
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        if line.startswith("| `"):
            rows[cells[0].strip("`")] = cells
    return rows


def test_every_config_key_has_a_row():
    rendered = config_doc.render()
    for name, section in Config.model_fields.items():
        assert f"## `[{name}]`" in rendered
        rows = _rows(name)
        model = section.annotation
        assert set(rows) == set(model.model_fields), name


def test_row_holds_type_default_allowed_values_and_description():
    rows = _rows("pipeline")
    _, kind, default, allowed, description = rows["mode"]
    assert (kind, default) == ("string", '`"sync"`')
    assert allowed == '`"sync"`, `"periodic"`, `"offpolicy"`'
    assert description.startswith("sync: train once the whole batch is generated")
    assert rows["num_workers"][1:4] == ["integer", "`1`", "`>= 1`"]
    assert rows["ray_address"][1:3] == ["string (optional)", "unset"]
    assert _rows("data")["heldout_fraction"][3] == "`>= 0.0`, `< 1.0`"


def test_quoted_error_is_the_one_validation_gives():
    assert (
        "cadence: error: config key 'pipeline.mode': Input should be 'sync', 'periodic' or "
        "'offpolicy'"
    ) in config_doc.render()


class _Section(BaseModel):
    documented: int = Field(1, description="Has one.")
    undocumented: int = 0


class _Root(BaseModel):
    pipeline: _Section = Field(default_factory=_Section, description="A section.")


def test_field_without_description_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"'pipeline\.undocumented' has no description") as e:
        config_doc.render(_Root)
    assert "python -m cadence.config.doc" in str(e.value)


def test_check_flag_reports_a_stale_page(tmp_path, capsys):
    page = tmp_path / "config.md"
    assert config_doc.main(["--out", str(page)]) == 0
    assert config_doc.main(["--out", str(page), "--check"]) == 0
    page.write_text(page.read_text() + "edited by hand\n")
    assert config_doc.main(["--out", str(page), "--check"]) == 1
    assert "python -m cadence.config.doc" in capsys.readouterr().err
