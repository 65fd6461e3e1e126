// Bundles the chat page into dist/: dist/index.html and dist/assets/* (content-hashed names).
// `qwick serve` runs `npm ci && npm run build` here when dist/ is missing or older than the sources.
import { readFile, writeFile, rm, rename, mkdir } from 'node:fs/promises';
import * as esbuild from 'esbuild';

const tmp = 'dist.tmp';
await rm(tmp, { recursive: true, force: true });
await mkdir(`${tmp}/assets`, { recursive: true });

const result = await esbuild.build({
  entryPoints: { boot: 'src/boot.js', app: 'src/main.js', style: 'src/style.css' },
  bundle: true,
  minify: true,
  format: 'iife',
  target: ['es2020', 'chrome100', 'firefox100', 'safari15'],
  outdir: `${tmp}/assets`,
  entryNames: '[name]-[hash]',
  metafile: true,
  logLevel: 'warning',
});

const names = {};
for (const [file, info] of Object.entries(result.metafile.outputs)) {
  if (info.entryPoint) names[info.entryPoint] = file.slice(`${tmp}/`.length);
}
const html = (await readFile('index.html', 'utf8'))
  .replace('%BOOT_JS%', names['src/boot.js'])
  .replace('%APP_JS%', names['src/main.js'])
  .replace('%STYLE_CSS%', names['src/style.css']);
await writeFile(`${tmp}/index.html`, html);

// Swap the new build in (a server may be reading dist/ meanwhile).
await rm('dist.old', { recursive: true, force: true });
await rename('dist', 'dist.old').catch(() => {});
await rename(tmp, 'dist');
await rm('dist.old', { recursive: true, force: true });
console.log(`built dist/: ${Object.values(names).join(', ')}`);
