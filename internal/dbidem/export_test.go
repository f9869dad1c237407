package dbidem

import "time"

// SetBatchBound sets the bound of c's batch statements (CleanupBatchTimeout), for tests.
func SetBatchBound(c *Cleaner, d time.Duration) { c.bound = d }

// SetTableBusyPauses sets the pauses between a claim's probes that met a locked table, for a
// test that is not parallel; the returned function restores them.
func SetTableBusyPauses(p []time.Duration) func() {
	old := tableBusyPauses
	tableBusyPauses = p
	return func() { tableBusyPauses = old }
}
