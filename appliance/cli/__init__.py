"""The one command line entry point: `appliance <subcommand>`, one module per command group.

Exit statuses: 0 success, 1 runtime failure (engine gave up, checks failed),
2 bad usage or an invalid configuration (see common.CliError).
"""

from __future__ import annotations

import click

from appliance import __version__
from appliance.cli import configure, doctor, kernels, keys, models, plan, records, serve, upgrade


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="appliance")
def main() -> None:
    """Edge LLM inference appliance: one supervised vLLM behind a local OpenAI-compatible API."""


for command in (serve.serve, configure.config_group, configure.init_cmd, plan.plan_cmd, plan.gpus_cmd,
                models.model_group, keys.keys_group, doctor.doctor_cmd, kernels.kernels_group,
                records.escalations_group, records.requests_cmd, upgrade.upgrade_cmd, upgrade.rollback_cmd,
                upgrade.versions_cmd):
    main.add_command(command)

