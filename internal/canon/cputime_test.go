//go:build linux || darwin

package canon

import (
	"syscall"
	"time"
)

// cpuTime is the CPU time the process has used (user and system, every thread: the garbage
// collector's work counts), or -1 where it is not known. On a shared machine it varies less
// than the wall-clock time of a benchmark.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return -1
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
