"""The job API over HTTP: listeners, what is decided on a request's head, the path table, the routes of
jobs, sandboxes, terminals and the page, the metrics, and `refusals.STATUS` (errors to HTTP statuses).
Nothing below this wing knows HTTP."""
