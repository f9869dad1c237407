package canon

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"testing"
)

// shapeDigest is a digest of everything Compute returns for a shape at 1 KiB and 64 KiB.
func shapeDigest(s shape) string {
	h := sha256.New()
	for _, size := range []int{1 << 10, 64 << 10} {
		fp := Compute("POST", "/golden", s.gen(size))
		fmt.Fprintf(h, "%x %v %q\n", fp.Sum, fp.JSON, fp.Ambiguous)
		names := make([]string, 0, len(fp.Fields))
		for n := range fp.Fields {
			names = append(names, n)
		}
		slices.Sort(names)
		for _, n := range names {
			fmt.Fprintf(h, "%q %s\n", n, fp.Fields[n])
		}
	}
	return hex.EncodeToString(h.Sum(nil))
}

// goldenShapes are the shape digests as the first canonicalizer (before the linear-time member
// sort and case check) computed them: a change of the sort or of the case check must leave
// every fingerprint of these adversarial bodies as it was. One digest changed on purpose since:
// wide_long_prefix at 64 KiB has member names of more than MaxFieldNameBytes together, so it
// reports no field hashes (D153); its Sum and JSON are as they were. The shape fields itself
// changed: its generator made 111 to 118 members, so no field hash at all; it makes exactly 64
// now (its digest and fields_growing_numbers' computed by the tree before one pass wrote the
// field hashes, writeFields).
var goldenShapes = map[string]string{
	"wide_long_prefix":       "5566c398a86d1316a845df8490d810bc2900b05b6c28510e22e2e407440a08c0",
	"deep_arrays":            "f7326e5cb7f3d45ce9e662a8da3c7106db350705eb21c149cc23cfb2bafa6dfd",
	"objects_256":            "76472ae925a149c429ee3100898ec6ff137d8d5094feebc6fbf1c7409d211212",
	"numbers_long":           "8d48b5915a683db2bac9ddfa9b27fc3371d1b1af1a86493505424633179c4e0e",
	"many_keys":              "f73c2ecaf103f3d75b86f28e7e5618b1245f38beb8c8961032d3cf225fe9b703",
	"deep":                   "2df67f896bc213ccf3b57b10063c8ea7220b620bdd73ae8b1d4aa3b44698067d",
	"numbers":                "a0529e403ac078329edfd9a53fa2bcbd80cf76f269072bfb81e7a1fec84a0566",
	"wide":                   "601459bca0e0d7ddbefdbc6a45e36d5c9d84d21cf17111d0ebdb4d7e39a699a6",
	"wide_prefix":            "754c499dcb5df6d8700683d00abe8625a06a9fcd85a0b516011fb2a6e63d0a0d",
	"wide_prefix_utf8":       "4cf7f1427d91dd52c9df5d11f2ad2f9eadfbfbaf9d75af543b3788a1f4401660",
	"wide_prefix_astral":     "d5ae772647c8c9d1dd17263c9b530f59bacd01e333d548ca229f03c81c037e21",
	"wide_escaped":           "3c3f987d15bf9d5a4da7b98dcf248d87f5aa0adb4a59b8a0b04e45a02120e261",
	"near_dups":              "f6795ee78ed208f450cde9c0753f70e5326bd25482a222b2859bfd1d94a379d0",
	"near_dups_small":        "1943fe050967b24fa847deb0e36338b44b511a3afe8239deec167d18e0bfa5f2",
	"case_across":            "b5be68cea0f0e73d8dce7b40bc6df62eb68781a3af0a3b0f3fdc55f19153af28",
	"case_across_small":      "5cb21a94b239950996056345d750cc598195384728c356572ded10a1ac919c39",
	"objects":                "e5e6d2d1b3770870cee35ac2da8faac151d0db104354dbd6dc6751b5412e586c",
	"empty":                  "a8655f4f46ca38ee67fafb42aca2f6dce0d728269ecb16426ba482249278bf8a",
	"tiny_values":            "96a1d8285d5c1e564e8371978c7c5f29baf7aa13fa2c9450639b3503dee2883d",
	"string_escapes":         "3262c370bb34e4bd3e71b88022aefe1de6d4dcf40b546102000de760e9592a09",
	"string_utf8":            "8e5c74c1615c7bd578c524d8b44cfbf6586e69a85aae315c15390ff88db224e2",
	"numbers_mixed":          "d757c8897f3cad05b33e2e76fa54dbc642532a6ae89e90073a51d9e3b6765d36",
	"numbers_huge_exp":       "573eb5d5efcaab0cbdb7a9d18dfe4ff6d493e84b38b0bdcdf79f0277149ce858",
	"fields":                 "1090855459bb6473cb37b9ad4edab1179dafca6272f3b35168994db5a8ca08e5",
	"fields_growing_numbers": "32f84c79b0e3e6def2016736f1b3529b09b7bc8abc11a4b5e9f4d2d27517a7f7",
	"deep_past":              "327f0bf973fd1485bfbd3dbc2b96c0f882f67b285696cf54d00098fb30978b35",
	"wide_dup":               "971ec50bb44b4cd88e8bee561d454cbcb6579edb92ea170d48bbf25cbe3bf4cf",
}

func TestShapesGolden(t *testing.T) {
	for _, s := range shapes {
		got := shapeDigest(s)
		if want, ok := goldenShapes[s.name]; !ok {
			t.Errorf("no golden digest for shape %s: %s", s.name, got)
		} else if got != want {
			t.Errorf("shape %s: digest %s, want %s", s.name, got, want)
		}
	}
}
