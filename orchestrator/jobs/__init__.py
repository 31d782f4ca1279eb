"""The job path: the Celery app (celery_app) and its tasks (tasks), sending messages (dispatch),
running a job or a deployment on a worker (worker), what beat's sweeps do (reconciler, health),
submitting and scheduling jobs (jobservice), a finished batch's analysis and its further rounds
(batch_analysis), and sending notifications (notify). Above the analysis, the store and the
transports; called by the services and the faces."""
