"""ZeRO stages 0-3: the stage plan and lifecycle (``stage``), the byte/memory table
(``plan``) and stage-3 unit gathering (``stage3``)."""
