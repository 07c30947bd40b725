"""Loaded by Python at startup when `phasescope run` put this folder on PYTHONPATH.

Installs phasescope's auto-attach (see phasescope.agent.probe.autoattach), then runs
the `sitecustomize` this one shadows, if there is one. Never raises, never prints.
"""


def _phasescope_bootstrap() -> None:
    import importlib.machinery
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        from phasescope.agent.probe.autoattach import install

        install()
    except Exception as exc:  # noqa: BLE001 - the program must run regardless
        import logging

        logging.getLogger("phasescope.autoattach").debug("bootstrap failed: %r", exc)
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


_phasescope_bootstrap()
