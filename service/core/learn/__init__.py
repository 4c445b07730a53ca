"""What is learned of the workers' steps: the step-time model (step_model), each worker's
measurements (step_times) and what they say of a deadline (deadlines)."""
