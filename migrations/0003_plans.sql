-- The planner's record (supervisor/planner.rs): per attempt, the device kind it ran on, what was
-- predicted for its configuration (allocated peak; tokens/s as planned, calibrated, and as the
-- uncalibrated step-time model gave it) and the plan it came from (candidates, verdicts, the
-- margin and calibration in force), as JSON. Predicted against measured peaks and tokens/s of a
-- device's attempts is the history the planner learns its margin and speed scale from.
ALTER TABLE attempts ADD COLUMN device_kind TEXT;
ALTER TABLE attempts ADD COLUMN predicted_allocated INTEGER;
ALTER TABLE attempts ADD COLUMN predicted_tokens_per_s REAL;
ALTER TABLE attempts ADD COLUMN model_tokens_per_s REAL;
ALTER TABLE attempts ADD COLUMN plan_json TEXT;
CREATE INDEX attempts_device ON attempts(device_kind, id);
