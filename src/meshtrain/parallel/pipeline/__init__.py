"""Pipeline parallelism: schedules as action lists, their validator, model splitting and
the runtime that executes a rank's actions (see docs/pipeline.md)."""
