"""The layout's rules, computed from the code's own imports, so a change that breaks one fails here:

- no service (coordinator, rollout, trainer, cli, ray_stack) imports another's modules; the CLI reaches
  the services only through the REST API and contract/;
- contract/ imports no torch, no service, no kernel; kernels import no service; the shared packages
  (services/common, services/environments) import no service;
- no two modules import each other, directly or around a longer loop (lazy imports count);
- production files stay under 600 lines and folders at about a dozen modules.

tests/support/import_graph.py reads the graph; the last tests here check that it finds what it must
on a small tree built for them.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.import_graph import boundary_violations, describe_cycle, import_cycles, read_graph

REPO = Path(__file__).resolve().parent.parent
PRODUCTION = ("contract", "services", "kernels", "recipes")
GENERATED = {"proto/lockstep_pb2.py", "proto/lockstep_pb2_grpc.py", "proto/rendezvous_pb2.py",
             "proto/rendezvous_pb2_grpc.py"}
MAX_LINES = 600
MAX_MODULES_PER_FOLDER = 13
"""About a dozen: counted without __init__.py and __main__.py."""


@pytest.fixture(scope="module")
def graph():
    return read_graph(REPO)


def test_the_graph_sees_the_whole_tree(graph):
    # A reader that silently skipped files would pass every rule below.
    assert "services.rollout.embedded.decoder" in graph.modules
    assert "services.coordinator.run.loop" in graph.modules
    assert "services.rollout.engine" in graph.edges["services.rollout.embedded.torch_engine"]
    assert "torch" in graph.external["services.trainer.trainer"]


def test_no_import_crosses_a_boundary(graph):
    assert boundary_violations(graph) == []


def test_the_cli_imports_no_service_package(graph):
    cli = {m: t for m, t in graph.edges.items() if m.startswith("services.cli")}
    assert cli, "no CLI modules found"
    reached = sorted(f"{m} -> {t}" for m, targets in cli.items() for t in targets
                     if not t.startswith(("services.cli", "services.common", "contract", "proto")))
    assert reached == []


def test_contract_stays_free_of_torch_and_services(graph):
    for module, targets in graph.edges.items():
        if module.startswith("contract"):
            assert [t for t in targets if not t.startswith(("contract", "proto"))] == [], module
            assert "torch" not in graph.external[module], module


def test_no_import_cycle(graph):
    assert [describe_cycle(graph, c) for c in import_cycles(graph)] == []


def test_production_files_stay_under_the_line_limit():
    long = []
    for package in PRODUCTION:
        for path in (REPO / package).rglob("*.py"):
            if str(path.relative_to(REPO)) not in GENERATED and len(path.read_text().splitlines()) > MAX_LINES:
                long.append(str(path.relative_to(REPO)))
    assert long == []


def test_production_folders_hold_about_a_dozen_modules():
    crowded = []
    for package in PRODUCTION:
        for folder in [REPO / package, *(p for p in (REPO / package).rglob("*") if p.is_dir())]:
            modules = [p for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
            if len(modules) > MAX_MODULES_PER_FOLDER:
                crowded.append(f"{folder.relative_to(REPO)}: {len(modules)}")
    assert crowded == []


# ---------------------------------------------------------------- the checker itself, on a built tree

def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


BASE = {
    "contract/__init__.py": "",
    "contract/options.py": "import pydantic\n",
    "services/__init__.py": "",
    "services/common/__init__.py": "",
    "services/common/auth.py": "",
    "services/cli/__init__.py": "",
    "services/cli/client.py": "from services.common.auth import x\nfrom contract.options import y\n",
    "services/trainer/__init__.py": "",
    "services/trainer/trainer.py": "import torch\nfrom services.trainer import loss\n",
    "services/trainer/loss.py": "def f():\n    from kernels.logprob import api\n",
    "kernels/__init__.py": "",
    "kernels/logprob/__init__.py": "",
    "kernels/logprob/api.py": "from contract.options import y\n",
}


def test_the_checker_passes_a_clean_tree(tmp_path):
    graph = read_graph(_tree(tmp_path, BASE))
    assert boundary_violations(graph) == []
    assert import_cycles(graph) == []
    assert graph.edges["services.trainer.trainer"] == {"services.trainer.loss": 2}


def test_the_checker_finds_a_cli_import_of_a_service(tmp_path):
    graph = read_graph(_tree(tmp_path, {**BASE, "services/cli/replay.py": "def run():\n"
                                        "    from services.trainer.loss import f\n"}))
    assert boundary_violations(graph) == [
        "services.cli.replay:2 imports services.trainer.loss (a service imports no other service's modules)"]


def test_the_checker_finds_torch_or_a_service_in_contract(tmp_path):
    graph = read_graph(_tree(tmp_path, {**BASE, "contract/options.py": "import torch\nimport services.common.auth\n"}))
    assert boundary_violations(graph) == [
        "contract.options:2 imports services.common.auth (contract/ imports no service, kernel or recipe)",
        "contract.options:1 imports torch (contract/ stays torch- and grpc-free)",
    ]


def test_the_checker_finds_a_kernel_importing_a_service(tmp_path):
    graph = read_graph(_tree(tmp_path, {**BASE, "kernels/logprob/api.py": "from services.trainer import loss\n"}))
    assert boundary_violations(graph) == [
        "kernels.logprob.api:1 imports services.trainer.loss (kernels import no service)"]


def test_the_checker_finds_a_cycle_closed_by_a_lazy_import(tmp_path):
    graph = read_graph(_tree(tmp_path, {**BASE, "services/trainer/loss.py": "def f():\n"
                                        "    from services.trainer.trainer import g\n"}))
    assert import_cycles(graph) == [["services.trainer.loss", "services.trainer.trainer"]]
    assert describe_cycle(graph, ["services.trainer.loss", "services.trainer.trainer"]) == (
        "services.trainer.loss (line 2) -> services.trainer.trainer (line 2) -> services.trainer.loss")


def test_the_checker_finds_a_longer_cycle_through_relative_imports(tmp_path):
    graph = read_graph(_tree(tmp_path, {
        **BASE,
        "services/common/a.py": "from . import b\n",
        "services/common/b.py": "from .c import thing\n",
        "services/common/c.py": "from services.common.a import other\n",
    }))
    assert import_cycles(graph) == [["services.common.a", "services.common.b", "services.common.c"]]
