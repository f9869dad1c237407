package canon

import (
	"bytes"
	"strconv"
)

// number reads a JSON number and returns its canonical text (see the package comment): the
// literal itself when it already is canonical, else a copy.
func (p *parser) number() (span, error) {
	lit := p.pos
	neg := false
	if p.data[p.pos] == '-' {
		neg = true
		p.pos++
	}
	s := p.digits()
	intPart := p.data[s:p.pos]
	if len(intPart) == 0 || (len(intPart) > 1 && intPart[0] == '0') {
		return span{}, p.fail("invalid number")
	}
	var fracPart []byte
	if p.pos < len(p.data) && p.data[p.pos] == '.' {
		p.pos++
		s := p.digits()
		fracPart = p.data[s:p.pos]
		if len(fracPart) == 0 {
			return span{}, p.fail("invalid number: no digit after '.'")
		}
	}
	if p.pos == len(p.data) || (p.data[p.pos] != 'e' && p.data[p.pos] != 'E') {
		// No exponent: most literals are canonical already (an integer of at most 21 digits
		// other than -0; a fraction that ends in a nonzero digit, of an integer part of at
		// most 21 digits, or below 1 with fewer than six zeros after the point).
		canonical := len(intPart) <= 21 && !(neg && intPart[0] == '0')
		if fracPart != nil {
			zeros := 0
			for zeros < len(fracPart) && fracPart[zeros] == '0' {
				zeros++
			}
			canonical = len(intPart) <= 21 && fracPart[len(fracPart)-1] != '0' && (intPart[0] != '0' || zeros < 6)
		}
		if canonical {
			return span{int32(lit), int32(p.pos - lit)}, nil
		}
		return p.decimal(lit, neg, intPart, fracPart, 0), nil
	}
	p.pos++
	expNeg := false
	if p.pos < len(p.data) && (p.data[p.pos] == '+' || p.data[p.pos] == '-') {
		expNeg = p.data[p.pos] == '-'
		p.pos++
	}
	s = p.digits()
	if s == p.pos {
		return span{}, p.fail("invalid number: no digit in the exponent")
	}
	ed := bytes.TrimLeft(p.data[s:p.pos], "0")
	if len(ed) > maxExponentDigits || (p.before178 && len(ed) > maxExponentDigits-1) {
		return span{}, p.fail("exponent too long")
	}
	var exp int64
	for _, c := range ed {
		exp = exp*10 + int64(c-'0')
	}
	if expNeg {
		exp = -exp
	}
	sp := p.decimal(lit, neg, intPart, fracPart, exp)
	// The canonical exponent may take a digit more than the literal's (10e9999999999999999 is
	// 1e+10000000000000000): such a text would not be strictly valid as a body of its own, and
	// hashed as its bytes, the very bytes of this canonical form. Refused alike, so that a
	// canonical text always canonicalizes again to itself (D178).
	txt := p.data
	off := int(sp.off)
	if sp.off < 0 {
		txt, off = p.arena, int(-sp.off-1)
	}
	if e := bytes.IndexByte(txt[off:off+int(sp.n)], 'e'); e >= 0 && int(sp.n)-e-2 > maxExponentDigits && !p.before178 {
		return span{}, p.fail("exponent too long")
	}
	return sp, nil
}

// digits skips the decimal digits at p.pos and returns where they started.
func (p *parser) digits() int {
	s := p.pos
	for p.pos < len(p.data) && p.data[p.pos] >= '0' && p.data[p.pos] <= '9' {
		p.pos++
	}
	return s
}

// decimal returns the canonical text of the number literal data[lit:pos]: the literal when
// it is canonical, else a copy in the arena. The text is laid out in the arena directly and
// dropped again when it equals the literal.
func (p *parser) decimal(lit int, neg bool, intPart, fracPart []byte, exp int64) span {
	// The layout is at most the significant digits and 30 bytes more: a sign, a point, five
	// zeros after "0.", or the zeros up to 21 digits, or "e", a sign and 20 digits.
	p.reserve(len(intPart) + len(fracPart) + 32)
	o := len(p.arena)
	p.arena = appendDecimal(p.arena, neg, intPart, fracPart, exp)
	if bytes.Equal(p.arena[o:], p.data[lit:p.pos]) {
		p.arena = p.arena[:o]
		return span{int32(lit), int32(p.pos - lit)}
	}
	return span{int32(-o - 1), int32(len(p.arena) - o)}
}

// zeros are the most zeros appendDecimal writes in a row (an integer of 21 digits).
const zeros = "000000000000000000000"

// appendDecimal appends the exact value ±(intPart.fracPart × 10^exp) in the ECMAScript
// Number-to-String layout that RFC 8785 prescribes, using the literal's significant digits.
func appendDecimal(b []byte, neg bool, intPart, fracPart []byte, exp int64) []byte {
	// value = 0.d1d2d3... × 10^point, with the digits taken from intPart and then fracPart
	point := int64(len(intPart)) + exp
	lead := 0
	for lead < len(intPart) && intPart[lead] == '0' {
		lead++
	}
	a, c := intPart[lead:], fracPart // the significant digits are a followed by c
	point -= int64(lead)
	if len(a) == 0 {
		z := 0
		for z < len(c) && c[z] == '0' {
			z++
		}
		c = c[z:]
		point -= int64(z)
	}
	c = bytes.TrimRight(c, "0")
	if len(c) == 0 {
		a = bytes.TrimRight(a, "0")
	}
	k := int64(len(a) + len(c))
	if k == 0 {
		return append(b, '0')
	}
	digit := func(i int64) byte {
		if i < int64(len(a)) {
			return a[i]
		}
		return c[i-int64(len(a))]
	}
	digits := func(b []byte, from, to int64) []byte { // digit(from) to digit(to-1), copied
		if la := int64(len(a)); from < la {
			b = append(b, a[from:min(to, la)]...)
			from = min(to, la)
		}
		if from < to {
			b = append(b, c[from-int64(len(a)):to-int64(len(a))]...)
		}
		return b
	}
	if neg {
		b = append(b, '-')
	}
	n := point
	switch {
	case k <= n && n <= 21:
		b = digits(b, 0, k)
		b = append(b, zeros[:n-k]...)
	case 0 < n && n <= 21:
		b = digits(b, 0, n)
		b = append(b, '.')
		b = digits(b, n, k)
	case -6 < n && n <= 0:
		b = append(b, '0', '.')
		b = append(b, zeros[:-n]...)
		b = digits(b, 0, k)
	default:
		b = append(b, digit(0))
		if k > 1 {
			b = append(b, '.')
			b = digits(b, 1, k)
		}
		b = append(b, 'e')
		if n-1 >= 0 {
			b = append(b, '+')
		}
		b = strconv.AppendInt(b, n-1, 10)
	}
	return b
}
