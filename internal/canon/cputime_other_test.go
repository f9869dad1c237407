//go:build !(linux || darwin)

package canon

import "time"

func cpuTime() time.Duration { return -1 }
