//go:build !race

package tests

// raceEnabled: the tests run under the race detector (go test -race).
const raceEnabled = false
