"""The contract every objective implements and dew-train calls: ``Objective`` with its
roles and phases, ``Step`` / ``Updates`` / ``EMA`` (``objective``), the batch fields it
reads (``batch``) and values with their weights (``weighted``). It imports nothing
else of dew-objectives."""
