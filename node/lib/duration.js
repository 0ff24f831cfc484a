'use strict';
// Durations as the options take them: interval text ('30 s', '500 ms') or a
// number of milliseconds.

// '30 s', '500 ms' as they are, for an interval argument; a number is
// milliseconds.
function intervalText(value) {
	if (typeof value === 'number') {
		if (!Number.isFinite(value)) {
			throw new TypeError(`not a duration: ${value}`);
		}
		return `${value} milliseconds`;
	}
	return String(value);
}

// a positive duration as whole milliseconds (for statement_timeout): a
// number is milliseconds; text is a number and a unit, such as '2 s',
// '500 ms', '1 min'
const UNITS = {
	ms: 1, millisecond: 1, milliseconds: 1, s: 1000, sec: 1000, second: 1000, seconds: 1000,
	min: 60000, minute: 60000, minutes: 60000,
};
function milliseconds(value, name = 'waitTimeout') {
	if (typeof value === 'number' && Number.isFinite(value) && value > 0) {
		return Math.ceil(value);
	}
	const m = /^\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*$/.exec(typeof value === 'string' ? value : '');
	if (!m || !Object.hasOwn(UNITS, m[2]) || Number(m[1]) <= 0) {
		throw new TypeError(`${name} must be a positive number of milliseconds or a duration such as '2 s', ` +
			`not ${JSON.stringify(value)}`);
	}
	return Math.ceil(Number(m[1]) * UNITS[m[2]]);
}

module.exports = { intervalText, milliseconds };
