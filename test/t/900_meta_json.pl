# 900_meta_json: META.json is a valid PGXN distribution description (PGXN
# Meta Spec 1.0.0, https://pgxn.org/meta/spec.txt, whose JSON Schema form
# is pgxn/meta's schema/v1), and its versions agree with
# idempotency.control and with the Debian packaging.
#
# The validator below follows the spec's rules field by field.  It is
# itself tested first, on broken copies of META.json, so that a validator
# that accepts anything cannot pass this file.  No server is needed.

use strict;
use warnings FATAL => 'all';

use File::Basename qw(dirname);
use File::Spec;
use JSON::PP;
use Test::More;

my $root = File::Spec->rel2abs(dirname(__FILE__) . '/../..');

sub slurp
{
	my ($path) = @_;
	open my $fh, '<:raw', "$root/$path" or die "cannot read $path: $!";
	local $/;
	return scalar <$fh>;
}

# ---------------------------------------------------------------- the rules

my $SEMVER = qr/^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)
	(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?
	(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$/x;

my %LICENSES = map { $_ => 1 } qw(
  agpl_3 apache_1_1 apache_2_0 artistic_1 artistic_2 bsd freebsd gfdl_1_2
  gfdl_1_3 gpl_1 gpl_2 gpl_3 lgpl_2_1 lgpl_3_0 mit mozilla_1_0 mozilla_1_1
  openssl perl_5 postgresql qpl_1_0 ssleay sun zlib open_source restricted
  unrestricted unknown);

my %TOP_KEYS = map { $_ => 1 } qw(name version abstract maintainer license
  provides meta-spec description generated_by tags no_index prereqs
  release_status resources);
my @REQUIRED = qw(name version abstract maintainer license provides meta-spec);

sub is_string { my ($v) = @_; return defined $v && !ref $v; }
sub is_term { my ($v) = @_; return is_string($v) && $v =~ /^[^\/\\\p{Space}\p{Cntrl}]{2,}$/; }
sub is_path
{
	my ($v) = @_;
	return is_string($v) && $v ne '' && $v !~ m{^/} && $v !~ m{\\}
	  && !grep { $_ eq '..' } split m{/}, $v;
}
sub custom_key { my ($k) = @_; return $k =~ /^[xX]_./; }

sub is_version_range
{
	my ($v) = @_;
	return 0 unless is_string($v);
	return 1 if $v eq '0';
	for my $part (split /,\s*/, $v, -1)
	{
		my ($op, $ver) = $part =~ /^(?:([=!]=|[<>]=?)\s*)?(.*)$/;
		return 0 unless $ver =~ $SEMVER || (!defined $op && $ver eq '0');
	}
	return 1;
}

# validate_meta(\%meta) -> list of problems (empty: valid)
sub validate_meta
{
	my ($m) = @_;
	my @err;
	return ('the document is not a JSON object') unless ref $m eq 'HASH';

	for my $k (@REQUIRED)
	{
		push @err, "required field \"$k\" is missing" unless exists $m->{$k};
	}
	for my $k (sort keys %$m)
	{
		push @err, "unknown field \"$k\"" unless $TOP_KEYS{$k} || custom_key($k);
	}

	push @err, 'name must be a term (2+ characters, no slash, backslash, space or control character)'
	  if exists $m->{name} && !is_term($m->{name});
	push @err, 'version must be a semantic version'
	  if exists $m->{version} && !(is_string($m->{version}) && $m->{version} =~ $SEMVER);
	for my $k (qw(abstract description generated_by))
	{
		push @err, "$k must be a non-empty string"
		  if exists $m->{$k} && !(is_string($m->{$k}) && length $m->{$k});
	}

	if (exists $m->{maintainer})
	{
		my $mt = $m->{maintainer};
		my @list = ref $mt eq 'ARRAY' ? @$mt : ($mt);
		my %seen;
		push @err, 'maintainer must be a non-empty string or a non-empty array of distinct non-empty strings'
		  if !@list || grep { !(is_string($_) && length $_) || $seen{$_}++ } @list;
	}

	if (exists $m->{license})
	{
		my $l = $m->{license};
		if (ref $l eq 'HASH')
		{
			push @err, 'license object must map names to URIs'
			  if !%$l || grep { !(is_string($_) && m{^[a-z][a-z0-9+.-]*:}i) } values %$l;
		}
		else
		{
			my @list = ref $l eq 'ARRAY' ? @$l : ($l);
			push @err, 'license must be one of the spec\'s license strings'
			  if !@list || grep { !(is_string($_) && $LICENSES{$_}) } @list;
		}
	}

	if (exists $m->{'meta-spec'})
	{
		my $ms = $m->{'meta-spec'};
		if (ref $ms ne 'HASH')
		{
			push @err, 'meta-spec must be an object';
		}
		else
		{
			push @err, 'meta-spec version must be 1.0.x'
			  unless is_string($ms->{version}) && $ms->{version} =~ /^1\.0\.\d+$/;
			push @err, 'meta-spec url must be https://pgxn.org/meta/spec.txt'
			  if exists $ms->{url} && !(is_string($ms->{url}) && $ms->{url} =~ m{^https?://pgxn\.org/meta/spec\.txt$});
			push @err, "unknown meta-spec field \"$_\""
			  for grep { $_ ne 'version' && $_ ne 'url' && !custom_key($_) } sort keys %$ms;
		}
	}

	if (exists $m->{provides})
	{
		my $p = $m->{provides};
		if (ref $p ne 'HASH' || !%$p)
		{
			push @err, 'provides must be a non-empty object';
		}
		else
		{
			for my $ext (sort keys %$p)
			{
				my $e = $p->{$ext};
				push @err, "provides: \"$ext\" is not a term" unless is_term($ext);
				if (ref $e ne 'HASH')
				{
					push @err, "provides.$ext must be an object";
					next;
				}
				push @err, "provides.$ext.version must be a semantic version"
				  unless is_string($e->{version}) && $e->{version} =~ $SEMVER;
				push @err, "provides.$ext.file must be a relative unix path"
				  unless is_path($e->{file});
				push @err, "provides.$ext.docfile must be a relative unix path"
				  if exists $e->{docfile} && !is_path($e->{docfile});
				push @err, "provides.$ext.abstract must be a non-empty string"
				  if exists $e->{abstract} && !(is_string($e->{abstract}) && length $e->{abstract});
				push @err, "unknown field provides.$ext.$_"
				  for grep { !/^(file|version|abstract|docfile)$/ && !custom_key($_) } sort keys %$e;
			}
		}
	}

	if (exists $m->{prereqs})
	{
		my $pr = $m->{prereqs};
		if (ref $pr ne 'HASH')
		{
			push @err, 'prereqs must be an object';
		}
		else
		{
			for my $phase (sort keys %$pr)
			{
				next if custom_key($phase);
				if ($phase !~ /^(configure|build|test|runtime|develop)$/)
				{
					push @err, "unknown prereqs phase \"$phase\"";
					next;
				}
				my $rels = $pr->{$phase};
				if (ref $rels ne 'HASH' || !grep { /^(requires|recommends|suggests|conflicts)$/ } keys %$rels)
				{
					push @err, "prereqs.$phase must have requires, recommends, suggests or conflicts";
					next;
				}
				for my $rel (sort keys %$rels)
				{
					next if custom_key($rel);
					if ($rel !~ /^(requires|recommends|suggests|conflicts)$/)
					{
						push @err, "unknown prereqs.$phase relationship \"$rel\"";
						next;
					}
					my $set = $rels->{$rel};
					if (ref $set ne 'HASH' || !%$set)
					{
						push @err, "prereqs.$phase.$rel must be a non-empty object";
						next;
					}
					for my $dep (sort keys %$set)
					{
						push @err, "prereqs.$phase.$rel: \"$dep\" is not a term" unless is_term($dep);
						push @err, "prereqs.$phase.$rel.$dep: \"" . ($set->{$dep} // 'null') . '" is not a version range'
						  unless is_version_range($set->{$dep});
					}
				}
			}
		}
	}

	if (exists $m->{release_status})
	{
		push @err, 'release_status must be stable, testing or unstable'
		  unless is_string($m->{release_status}) && $m->{release_status} =~ /^(stable|testing|unstable)$/;
	}

	if (exists $m->{tags})
	{
		my $t = $m->{tags};
		my %seen;
		push @err, 'tags must be a non-empty array of distinct strings of 2 to 255 characters without slash, backslash or control characters'
		  if ref $t ne 'ARRAY' || !@$t
		  || grep { !(is_string($_) && /^[^\/\\\p{Cntrl}]{2,255}$/) || $seen{$_}++ } @$t;
	}

	if (exists $m->{no_index})
	{
		my $n = $m->{no_index};
		if (ref $n ne 'HASH' || !grep { $_ eq 'file' || $_ eq 'directory' } keys %$n)
		{
			push @err, 'no_index must be an object with file and/or directory';
		}
		else
		{
			for my $k (sort keys %$n)
			{
				next if custom_key($k);
				if ($k ne 'file' && $k ne 'directory')
				{
					push @err, "unknown no_index field \"$k\"";
					next;
				}
				my @list = ref $n->{$k} eq 'ARRAY' ? @{ $n->{$k} } : ($n->{$k});
				push @err, "no_index.$k must be relative unix paths"
				  if !@list || grep { !is_path($_) } @list;
			}
		}
	}

	if (exists $m->{resources})
	{
		my $r = $m->{resources};
		push @err, 'resources must be an object with homepage, bugtracker or repository'
		  if ref $r ne 'HASH' || !grep { /^(homepage|bugtracker|repository)$/ } keys %$r;
	}
	return @err;
}

# --------------------------------------------------------------- META.json

my $text = slurp('META.json');
my $meta = eval { JSON::PP->new->utf8->relaxed(0)->decode($text) };
ok($meta, 'META.json is well-formed JSON') or diag($@);
$meta //= {};

# ------------------------------------------- the validator catches mistakes

my $json = JSON::PP->new->canonical;
my @broken = (
	[ 'no abstract', sub { delete $_[0]{abstract} }, qr/"abstract" is missing/ ],
	[ 'two-part version', sub { $_[0]{version} = '1.1' }, qr/^version must be a semantic/ ],
	[ 'unknown license', sub { $_[0]{license} = 'PostgreSQL License' }, qr/^license must be/ ],
	[ 'meta-spec 2', sub { $_[0]{'meta-spec'}{version} = '2.0.0' }, qr/meta-spec version must be 1\.0\.x/ ],
	[ 'extension without file',
		sub { delete $_[0]{provides}{idempotency}{file} }, qr/provides\.idempotency\.file/ ],
	[ 'bad prereq range',
		sub { $_[0]{prereqs}{runtime}{requires}{PostgreSQL} = '15' }, qr/is not a version range/ ],
	[ 'typo in a field name', sub { $_[0]{licence} = 'postgresql' }, qr/unknown field "licence"/ ],
	[ 'name with a space', sub { $_[0]{name} = 'idem potency' }, qr/^name must be a term/ ],
);
for my $case (@broken)
{
	my ($what, $break, $expect) = @$case;
	my $copy = $json->decode($json->encode($meta));
	$break->($copy);
	my @problems = validate_meta($copy);
	ok((grep { $_ =~ $expect } @problems), "validator rejects META.json with $what")
	  or diag(explain(\@problems));
}
ok(is_version_range('>= 15.0.0, < 19.0.0'), 'validator accepts an AND-ed version range');

# ------------------------------------------------------ META.json is valid

my @problems = validate_meta($meta);
is_deeply(\@problems, [], 'META.json follows the PGXN Meta Spec 1.0.0');

is($meta->{name}, 'idempotency', 'distribution name');
is($meta->{'meta-spec'}{version}, '1.0.0', 'meta-spec version 1.0.0');
is($meta->{license}, 'postgresql', 'license: PostgreSQL');
ok(-f "$root/$meta->{provides}{idempotency}{file}", 'provides.idempotency.file exists')
  if $meta->{provides}{idempotency}{file};
ok(-f "$root/$meta->{provides}{idempotency}{docfile}", 'provides.idempotency.docfile exists')
  if $meta->{provides}{idempotency}{docfile};

# PostgreSQL >= 15: the version range's lower bound is 15.0.0, inclusive
my $pg = $meta->{prereqs}{runtime}{requires}{PostgreSQL} // '';
my ($lower) = map { /^(?:>=\s*)?(\d+\.\d+\.\d+)$/ ? $1 : () } split /,\s*/, $pg;
is($lower, '15.0.0', "prereqs.runtime.requires.PostgreSQL ($pg) starts at 15.0.0");

# ------------------------------------------------------ versions agree

my $control = slurp('idempotency.control');
my ($default_version) = $control =~ /^\s*default_version\s*=\s*'([^']+)'/m;
ok(defined $default_version, "idempotency.control has a default_version");
$default_version //= '';
# SemVer of an extension version "X.Y" is "X.Y.0"
my $semver = $default_version =~ /^\d+\.\d+$/ ? "$default_version.0" : $default_version;
is($meta->{version}, $semver,
	"META.json version is default_version $default_version of idempotency.control");
is($meta->{provides}{idempotency}{version}, $semver,
	'provides.idempotency.version is the same');
ok(-f "$root/idempotency--$default_version.sql"
	  || grep({ /--\Q$default_version\E\.sql$/ } glob("$root/idempotency--*.sql")),
	"an install or upgrade script reaches $default_version");

# debian/changelog: "idempotency (UPSTREAM-REVISION) ..." on its first line
my ($deb_version) = slurp('debian/changelog') =~ /\A(\S+) \(([^)]+)\)/ ? ($2) : ();
my ($deb_upstream) = ($deb_version // '') =~ /^(?:\d+:)?(.*?)(?:-[^-]+)?$/;
is($deb_upstream, $meta->{version}, "debian/changelog's upstream version ($deb_version) is META.json's");
like(slurp('debian/control.in'), qr/^Package: postgresql-PGVERSION-idempotency$/m,
	'debian/control.in builds postgresql-PGVERSION-idempotency');

# the maintainer is the packaging's: debian/control names the same one
my ($deb_maintainer) = slurp('debian/control') =~ /^Maintainer:\s*(.+?)\s*$/m;
is_deeply($meta->{maintainer}, [$deb_maintainer], "maintainer is debian/control's ($deb_maintainer)");

# resources, when given, are real addresses: no reserved example domain
# (RFC 2606), no place-holder text
for my $k (sort keys %{ $meta->{resources} // {} })
{
	my $r = $meta->{resources}{$k};
	my @urls = ref $r eq 'HASH' ? grep { defined && !ref } values %$r : ($r);
	ok(!grep({ m{^\w+://([^/]*\.)?example(\.(com|org|net))?([:/]|$)}i || /place.?holder|TODO|XXX/i } @urls),
		"resources.$k is not a place-holder (@urls)");
}

# CHANGELOG.md: a stable release's section has a date, not "(unreleased)"
my ($major_minor) = $meta->{version} =~ /^(\d+\.\d+)\./;
my ($heading) = slurp('CHANGELOG.md') =~ /^(## \Q$major_minor\E\b.*)$/m;
ok(defined $heading, "CHANGELOG.md has a section for $major_minor");
like($heading // '', qr/^## \Q$major_minor\E \(\d{4}-\d{2}-\d{2}\)$/,
	"CHANGELOG.md dates $major_minor, which META.json releases as $meta->{release_status}")
  if ($meta->{release_status} // '') eq 'stable';

done_testing();
