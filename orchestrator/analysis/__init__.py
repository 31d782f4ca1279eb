"""The analysis, one package: pure statistics (stats: series keys, comparisons, change points,
attribution, fidelity, thermal flags), a finished batch's regression analysis on the store
(regressions), the series as a listing (series), a batch's summary (summary) and the profiles'
measured gains (profiles). Reads and writes through the store; knows nothing of Celery."""
