package history

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"strings"
	"time"
)

type phase uint8

const (
	free phase = iota // no live claim: never claimed, or released
	held              // a committed lease claim without an answer
	done              // an answer is stored
)

func (p phase) String() string { return [...]string{"free", "held", "done"}[p] }

// unknown stands for a value that exists but was not seen yet (an answer stored by an
// operation whose client never learned it, its effect, its provider key).
const unknown = "?"

// state is the model's state of one key. It is comparable (porcupine merges equal states).
type state struct {
	phase  phase
	gen    int    // generations so far
	fp     string // the current generation's fingerprint
	answer string // done: its answer, or unknown
	pk     string // its provider key, "" when not seen
	effect string // the effect its answer names: "" none, unknown when not seen
	// since is, when done, the earliest instant the answer can have been stored; when held,
	// the earliest instant the lease can end. The key expires at least ttl after it.
	since int64
	ttl   int64
	// releasable: the lease is held by an operation that may still release it (its outcome
	// allows a release), so a later claim may find the key free.
	releasable bool
	// What earlier generations left: provider keys seen, effects named, and how many had an
	// effect that nobody saw named.
	pastPKs     string
	pastEffects string
	pastUnknown int
}

// hash is a hash of every field (equal states hash alike).
func (s state) hash() uint64 {
	h := fnv.New64a()
	var b [8]byte
	releasable := int64(0)
	if s.releasable {
		releasable = 1
	}
	for _, n := range []int64{int64(s.phase), int64(s.gen), s.since, s.ttl, int64(s.pastUnknown), releasable} {
		binary.LittleEndian.PutUint64(b[:], uint64(n))
		h.Write(b[:])
	}
	for _, str := range []string{s.fp, s.answer, s.pk, s.effect, s.pastPKs, s.pastEffects} {
		h.Write([]byte(str))
		h.Write([]byte{0xff})
	}
	return h.Sum64()
}

func (s state) describe() string {
	if s.gen == 0 && s.phase == free {
		return "new key"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "gen %d %s", s.gen, s.phase)
	if s.phase != free {
		fmt.Fprintf(&b, " fp=%s", short(s.fp, 40))
	}
	switch s.phase {
	case done:
		fmt.Fprintf(&b, " answer=%s stored>=%s", short(s.answer, 60), at(s.since))
	case held:
		fmt.Fprintf(&b, " lease-end>=%s", at(s.since))
	}
	if s.pk != "" {
		fmt.Fprintf(&b, " pk=%s", short(s.pk, 12))
	}
	return b.String()
}

func at(ns int64) string { return fmt.Sprintf("+%.3fs", time.Duration(ns).Seconds()) }

func short(s string, n int) string {
	s = strings.ReplaceAll(strings.TrimSpace(s), "\n", " ")
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
