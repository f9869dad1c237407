package canon

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestBenchFieldsShapesHaveFields: docs/benchmarks.md says of the benchmark shape `fields`:
// "64 top-level members, so every byte is hashed twice". Its generator went on appending
// members "z64":0, "z65":0, ... once the 64 arrays were written, until the body was full: 111
// to 118 members, so Compute made no field hash and the benchmark never measured the per-field
// pass.
func TestBenchFieldsShapesHaveFields(t *testing.T) {
	n := 0
	for _, s := range shapes {
		if !strings.HasPrefix(s.name, "fields") {
			continue
		}
		n++
		for _, size := range benchSizes {
			body := s.gen(size)
			if fp := Compute("POST", "/bench", body); len(fp.Fields) != MaxFields {
				var top map[string]json.RawMessage
				_ = json.Unmarshal(body, &top)
				t.Errorf("shape fields at %d bytes: %d top-level members, %d field hashes; the docs say 64 members, every byte hashed twice",
					size, len(top), len(fp.Fields))
			}
		}
	}
	if n < 2 {
		t.Fatalf("%d shapes named fields*, want fields and fields_growing_numbers", n)
	}
}
