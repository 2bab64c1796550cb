"""The charts' READMEs and schema descriptions are what scripts/chart-docs.py makes of values.yaml."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_chart_readmes_and_schema_descriptions_are_current():
    out = subprocess.run([sys.executable, str(REPO / "scripts/chart-docs.py"), "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_documented_value_has_a_row_and_the_schema_admits_global():
    import json

    for chart in ("gpu-agent", "fake-gpu"):
        schema = json.loads((REPO / "charts" / chart / "values.schema.json").read_text())
        assert schema["properties"]["global"]["type"] == "object"
        readme = (REPO / "charts" / chart / "README.md").read_text()
        for key in schema["properties"]:
            if key != "global":
                assert f"| `{key}` |" in readme, (chart, key)
