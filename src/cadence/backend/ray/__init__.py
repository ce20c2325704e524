"""The Ray wing of the backend: the same workers, learner ranks, sample store and weight
transports as the local backend, as Ray actors on a cluster (docs/ray.md).

`cluster` starts or joins Ray and places by resources, `actors` are the rollout workers as actors
(inside each, and the driver's handles on them), `pool` their traffic as a Pool,
`ranks` learner ranks, `store` the sample store, `weights` the object-store and broadcast
transports, `reaper` what cleans up after a killed driver. Ray is imported inside these modules
only, on use: importing cadence never imports Ray. What the local backend shares with this wing
(the worker loop, the transports' Protocol, placement) stays beside it in `backend/`.
"""
