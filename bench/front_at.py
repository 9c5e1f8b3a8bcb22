"""The appliance's API as a commit of this repository built it, in front of an engine that is already
running: bench/gateway_overhead.py --also REF runs the change's parent and the working tree side by side
this way, in one run, against one engine.

    python bench/front_at.py CODE_ROOT CONFIG PORT

CODE_ROOT is a checkout of the commit (`git archive REF | tar -x`); CONFIG the running appliance's
configuration, whose state folder holds the engine's socket and key. What runs is that commit's own
composition root (its assembly.build) with a supervisor that finds the engine ready instead of starting
one, served by that commit's server configuration; the plan is the kvbudget model's (no vLLM probe), which
for the default model gives the engine's settings the daemon planned.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    code_root, cfg_path, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sys.path.insert(0, code_root)  # before the editable install's finder, which serves the working tree
    import uvicorn
    import uvloop

    try:  # the layout from issue 30 on
        from appliance.boot import assembly, config, planning
        from appliance.runtime.daemon import server_config
    except ImportError:  # the flat layout before it
        from appliance import assembly, config, planning  # type: ignore[no-redef, attr-defined]
        from appliance.daemon import server_config  # type: ignore[no-redef]
    import appliance
    from appliance.engine.args import build_launch
    from appliance.engine.supervisor import EngineState, EngineSupervisor

    assert Path(appliance.__file__).resolve().is_relative_to(Path(code_root).resolve()), appliance.__file__
    cfg = config.load(cfg_path)
    site_plan = planning.plan_for_config(cfg, ask_vllm=False)
    supervisor = EngineSupervisor(cfg, site_plan.plan.vllm_args)
    supervisor.internal_key = (cfg.state.directory / "engine.key").read_text().strip()  # the running engine's
    supervisor.launch = build_launch(cfg, supervisor.engine_args, supervisor.internal_key)
    supervisor.status.state = EngineState.READY
    daemon = assembly.build(cfg, site_plan, supervisor=supervisor)
    daemon.request_log.start()
    server = cfg.server.model_copy(update={"port": port})
    print(f"front of {code_root} ({appliance.__file__}) on port {port}", flush=True)
    try:  # the daemon settles its memory before serving from the commit that brought settle_memory on
        from appliance.runtime.daemon import settle_memory
    except ImportError:
        pass
    else:
        settle_memory()
    uvloop.run(uvicorn.Server(server_config(daemon.app, server)).serve())


if __name__ == "__main__":
    main()
