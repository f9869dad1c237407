package dbidem

import "time"

// SetBatchBound sets the bound of c's batch statements (CleanupBatchTimeout), for tests.
func SetBatchBound(c *Cleaner, d time.Duration) { c.bound = d }
