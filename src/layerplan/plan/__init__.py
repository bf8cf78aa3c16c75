"""Plans: the LayerPlan value and its human grammar (plan.py); other tools' formats and files
(formats.py)."""
