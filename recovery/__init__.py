"""In-process recovery runtime imported by training code (empty until the recovery work lands).

Depends on torch only, never on the agent's heavy modules.
"""
