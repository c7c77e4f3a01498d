"""The service's GitHub side: the runner desk (which runner's token binds which job), what the service does
when GitHub speaks (a queued job, a push), the pull request's check runs, and the App's settings.
The GitHub protocol itself (payloads, signatures, the REST calls) is runner.github's."""
