"""The floor: records and their wire format (`events`), addresses (`address`), the store's
schema (`schema`), KV page math (`kvmath`) and the library's errors (`errors`).

Stdlib (and numpy where a function takes arrays) only; imports nothing else of phasescope.
The probe, the sidecar, the read layer and everything above them stand on it.
"""
