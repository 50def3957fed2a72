"""LEMON orchestration (METHODS.md section 4): the executable spec language and its executor.

- :mod:`~lemon_rl.envs.orchestration.spec`: schema, parser/validator, serialiser, span maps, edits.
- :mod:`~lemon_rl.envs.orchestration.executor`: DAG compilation, worker pool, node cache, accounting.
"""

from lemon_rl.envs.orchestration.executor import (DEFAULT_TOKEN_PRICES, AgentPrompt, Execution, Executor, Graph,
                                                  ModelWorker, NodeCache, NodeOutput, NodeResult,
                                                  ProgrammaticWorker, Worker, WorkerOutput, compile_spec,
                                                  format_agent_prompt, node_key, parse_agent_prompt,
                                                  programmatic_pool)
from lemon_rl.envs.orchestration.spec import (CAPACITIES, DEFAULT_DUTIES, DEFAULT_ROLES, DEFAULT_SCHEMA,
                                              EDIT_FAMILIES, ERROR_CODES, Agent, Edit, Schema, Spec, SpecError,
                                              char_to_token_spans, drop_edge, enumerate_edits, field_name,
                                              lower_capacity, parse_spec, parse_spec_with_spans, reset_duty,
                                              serialize, token_char_ranges, validate_spec)

__all__ = [
    "Agent", "AgentPrompt", "CAPACITIES", "char_to_token_spans", "compile_spec", "DEFAULT_DUTIES", "DEFAULT_ROLES",
    "DEFAULT_SCHEMA", "DEFAULT_TOKEN_PRICES", "drop_edge", "Edit", "EDIT_FAMILIES", "enumerate_edits",
    "ERROR_CODES", "Execution", "Executor", "field_name", "format_agent_prompt", "Graph", "lower_capacity",
    "ModelWorker", "node_key", "NodeCache", "NodeOutput", "NodeResult", "parse_agent_prompt", "parse_spec",
    "parse_spec_with_spans", "programmatic_pool", "ProgrammaticWorker", "reset_duty", "Schema", "serialize", "Spec",
    "SpecError", "token_char_ranges", "validate_spec", "Worker", "WorkerOutput",
]
