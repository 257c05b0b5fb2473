-- Memory at one moment, so a page can stack what was live together: per step sample, what each
-- category held (and the pool reserved) when the step's allocated total peaked — the sum is the
-- sample's `allocated`, where the per-category columns are each category's own high-water mark
-- and may come from different moments; per OOM attempt, what each category held when the
-- request failed. NULL where a trainer did not report it (rows from before this migration).
ALTER TABLE samples ADD COLUMN at_peak_params INTEGER;
ALTER TABLE samples ADD COLUMN at_peak_grads INTEGER;
ALTER TABLE samples ADD COLUMN at_peak_optimizer INTEGER;
ALTER TABLE samples ADD COLUMN at_peak_activations INTEGER;
ALTER TABLE samples ADD COLUMN at_peak_workspace INTEGER;
ALTER TABLE samples ADD COLUMN at_peak_reserved INTEGER;
ALTER TABLE attempts ADD COLUMN oom_params INTEGER;
ALTER TABLE attempts ADD COLUMN oom_grads INTEGER;
ALTER TABLE attempts ADD COLUMN oom_optimizer INTEGER;
ALTER TABLE attempts ADD COLUMN oom_activations INTEGER;
ALTER TABLE attempts ADD COLUMN oom_workspace INTEGER;
ALTER TABLE attempts ADD COLUMN oom_reserved INTEGER;
