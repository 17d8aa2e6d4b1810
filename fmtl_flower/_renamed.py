"""The public names this package had before its classes followed PEP 8's rule for acronyms
(``MOCHA``, ``MbSGD``, ``FSVRG``, as ``FedEM`` and ``OFMTL`` already did): importing an old
name from the package root still works, with a ``DeprecationWarning``, and a checkpoint
written under an old name still resumes (:func:`fmtl_flower.checkpoint.check_fingerprint`)."""

#: former name -> current name, for the package root's deprecated aliases and the
#: strategy names stored in old checkpoints' fingerprints.
RENAMED = {
    "Mocha": "MOCHA",
    "MbSgd": "MbSGD",
    "Fsvrg": "FSVRG",
    "AsyncMocha": "AsyncMOCHA",
    "MochaSettings": "MOCHASettings",
    "MbSgdSettings": "MbSGDSettings",
    "FsvrgSettings": "FSVRGSettings",
    "MochaNumPyClient": "MOCHANumPyClient",
}
