"""verifiers environments (`env.kind = "verifiers"`): what cadence lends verifiers to run them.

Importing this package imports verifiers (the `verifiers` extra); nothing else in cadence does
until a run asks for it.
"""
